"""File helpers every tool shares: the sha256 of a file and the atomic write (standard library only).

An atomic write goes to a sibling temporary file (same filesystem), is flushed and fsynced, and is
renamed over its destination only when the whole write succeeded; the temporary file is removed on
any failure, and the directory is fsynced after the rename so the new name survives a crash.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

HASH_CHUNK = 1 << 22  # bytes per read() when hashing a file
STREAM_BLOCK = 1 << 22  # bytes per read() of a copy without a rate cap


def sha256_file(path: str | os.PathLike[str], chunk: int = HASH_CHUNK) -> str:
    """Hex sha256 of a file's bytes, read in ``chunk``-sized blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def existing_ancestor(path: str | os.PathLike[str]) -> Path:
    """``path`` itself when it exists, else its nearest existing parent: where it would be made."""
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still use on the filesystem that holds (or would hold) ``path``
    (statvfs f_bavail x f_frsize, as ``df`` shows them)."""
    return shutil.disk_usage(existing_ancestor(path)).free


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike[str], tag: str = "tmp") -> Iterator[Path]:
    """The one atomic write: yield ``.<name>.<tag>-<pid>`` next to ``path`` (nothing there yet) for
    the block to create: write, link or copy it. On a clean exit of the block the file is fsynced and
    renamed over ``path``, then the directory is fsynced; on any failure the temporary file is removed
    and ``path`` is left as it was."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{tag}-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(p.parent)


@contextmanager
def atomic_write(path: str | os.PathLike[str], tag: str = "tmp") -> Iterator[BinaryIO]:
    """``atomic_path`` with the temporary file open for binary writing. The block may read it back
    (``f.name``, after ``f.flush()``) and raise to refuse it: ``path`` is then left as it was."""
    with atomic_path(path, tag) as tmp, open(tmp, "wb") as f:
        yield f
        f.flush()


def place_atomic(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> bool:
    """Hard-link (same filesystem) or else copy ``src`` to ``dst`` atomically (``atomic_path``);
    True when linked."""
    with atomic_path(dst) as tmp:
        try:
            os.link(src, tmp)
            return True
        except OSError:
            with open(src, "rb") as fi, open(tmp, "wb") as fo:
                shutil.copyfileobj(fi, fo, STREAM_BLOCK)
            return False


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see ``atomic_write``)."""
    with atomic_write(path) as f:
        f.write(data)


def write_json_atomic(path: str | os.PathLike[str], doc: object, indent: int = 2) -> None:
    """``doc`` as indented JSON plus a newline, written atomically."""
    write_bytes_atomic(path, (json.dumps(doc, indent=indent, sort_keys=False) + "\n").encode("utf-8"))


class Throttle:
    """Caps a stream at ``rate`` bytes per second over its whole life (0: no cap)."""

    def __init__(self, rate: float) -> None:
        self.rate = max(0.0, rate)
        self.start = time.monotonic()
        self.bytes = 0

    @property
    def block(self) -> int:
        # small blocks under a low cap, so the flow is steady rather than bursts of 4 MiB
        return STREAM_BLOCK if not self.rate else int(min(STREAM_BLOCK, max(4096, self.rate / 8)))

    def account(self, n: int) -> None:
        self.bytes += n
        if self.rate:
            ahead = self.bytes / self.rate - (time.monotonic() - self.start)
            if ahead > 0:
                time.sleep(ahead)
