"""mirror and manifest: a checkpoint copied from a local or mounted mirror, verified against the
mirror's sparkllm-manifest.json (standard library only).

A mounted mirror (NFS, SMB) can fail like a network: a read that times out, a stale handle, a mount
whose server went away. Those errors are retried (the file starts over) with backoff, then end in one
line naming the problem; every file verified before is kept, so a rerun resumes.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

from ..checkpoint.hybrid import (
    MANIFEST_NAME,
    SOURCE_RECORD,
    CheckpointError,
    ManifestEntry,
    build_manifest,
    manifest_doc,
    read_manifest,
)
from ..fileio import Throttle, atomic_write, fsync_dir, write_json_atomic
from . import common
from .common import MIRROR_STATE, FetchError, Retry, TransientError, UsageError

# a mounted mirror's server or link failing, not the file: worth another try
MOUNT_ERRNOS = (errno.ETIMEDOUT, errno.ESTALE, errno.ENOTCONN, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                errno.ENETUNREACH, errno.ENETDOWN, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                errno.EIO)  # fmt: skip
MOUNT_FIX = "check the mirror's mount and its server, then rerun to resume"


def verified_files(dest: Path) -> dict[str, int]:
    """Files of ``dest`` this tool has verified and that are still as verified (size and mtime):
    name -> size. Read while a fetch runs, it lists the files that are complete already."""
    mirror = common.read_json(dest / MIRROR_STATE)
    hub = common.read_json(dest / SOURCE_RECORD).get("verified", {})
    out: dict[str, int] = {}
    for states in (hub if isinstance(hub, dict) else {}, mirror):
        for name, st in states.items():
            if common.still_verified(dest / name, st):
                out[name] = st["size"]
    return out


def copy_verified(src: Path, dst: Path, entry: ManifestEntry, throttle: Throttle | None = None) -> None:
    h = hashlib.sha256()
    throttle = throttle or Throttle(0)
    with open(src, "rb") as fi, atomic_write(dst, tag="incomplete") as fo:
        while block := fi.read(throttle.block):
            h.update(block)
            fo.write(block)
            throttle.account(len(block))
        size = fo.tell()
        if size != entry.size:
            raise FetchError(
                f"{src}: size {size} != manifest size {entry.size} (corrupt or incomplete mirror)"
            )
        if entry.sha256 and h.hexdigest() != entry.sha256:
            raise FetchError(f"{src}: sha256 differs from {MANIFEST_NAME} (corrupt mirror file)")


def mirror_fetch(src: Path, dest: Path, max_rate: float = 0, retry: Retry | None = None) -> dict[str, object]:
    if not src.is_dir():
        raise UsageError(
            f"{src}: --src is not a directory; pass the mirror directory (holding {MANIFEST_NAME})"
        )
    common.refuse_output(dest, "--dest", (("--src", src),))
    manifest_path = src / MANIFEST_NAME
    if not manifest_path.is_file():
        raise UsageError(
            f"{manifest_path}: mirror manifest missing; create it with `fetch_checkpoint.py manifest {src}`"
        )
    try:
        entries = read_manifest(manifest_path)
    except CheckpointError as exc:
        raise FetchError(str(exc)) from None
    common.claim_dir(dest, inputs=(("--src", src),))
    record_path = dest / SOURCE_RECORD
    record = common.read_json(src / SOURCE_RECORD)
    state = common.read_json(dest / MIRROR_STATE)
    retry = retry or Retry(fix=MOUNT_FIX)
    retry.fix = MOUNT_FIX

    def done(e: ManifestEntry) -> bool:
        s = state.get(e.name)
        same_sha = isinstance(s, dict) and s.get("sha256") == e.sha256
        return same_sha and common.still_verified(dest / e.name, s, e.size)

    todo = [e for e in entries if not done(e)]
    for e in todo:
        if not (src / e.name).is_file():
            raise FetchError(f"{src / e.name}: listed in {MANIFEST_NAME} but missing from the mirror")
    common.check_disk_space(dest, sum(e.size for e in todo))
    throttle = Throttle(max_rate)
    for e in todo:
        common.log(f"mirror: {e.name} ({common.gib(e.size)})")
        for sub in reversed((dest / e.name).relative_to(dest).parents[:-1]):
            common.make_dir(dest / sub)
        retry(lambda e=e: _copy_once(src, dest, e, throttle))
        state[e.name] = {"size": e.size, "sha256": e.sha256, "mtime_ns": (dest / e.name).stat().st_mtime_ns}
        write_json_atomic(dest / MIRROR_STATE, state)
    if record:
        write_json_atomic(record_path, {**record, "mirror": str(src)})
    fsync_dir(dest)
    return {"changed": bool(todo), "files": len(entries), "copied": len(todo)}


def write_manifest(directory: Path, with_sha256: bool) -> dict[str, object]:
    if not directory.is_dir():
        raise UsageError(f"{directory}: not a directory; pass the checkpoint directory to describe")
    entries = build_manifest(directory, with_sha256)
    write_json_atomic(directory / MANIFEST_NAME, manifest_doc(entries))
    return {"changed": True, "files": len(entries), "bytes": sum(e.size for e in entries)}


def _copy_once(src: Path, dest: Path, e: ManifestEntry, throttle: Throttle) -> None:
    try:
        copy_verified(src / e.name, dest / e.name, e, throttle)
    except OSError as exc:
        if exc.errno in MOUNT_ERRNOS:
            problem = f"the mirror {src} failed ({exc.strerror})"
            raise TransientError(f"{src / e.name}: {exc.strerror}", problem) from None
        raise FetchError(f"{exc.filename or src / e.name}: {exc.strerror}") from None
