"""fp8-extract: the FP8 checkpoint's index and shard headers read remotely with HTTP Range requests,
then only the selected tensors' byte ranges (standard library only: it runs on the Spark's python3).
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..checkpoint.hybrid import FP8_DTYPE, SOURCE_RECORD, is_expert, is_mtp, scale_name
from ..checkpoint.safetensors_io import (
    INDEX_NAME,
    MAX_HEADER_BYTES,
    ByteRange,
    Header,
    SafetensorsError,
    TensorSpec,
    check_header_len,
    coalesce,
    encode_header,
    parse_header_bytes,
    read_header,
)
from ..fileio import atomic_write, write_json_atomic
from . import common
from .common import CHUNK, TRANSIENT_HTTP, FetchError, Retry, TransientError, UsageError

CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")


COMMIT_RE = re.compile(r"[0-9a-f]{40}")


@dataclass
class Remote:
    """The Hub's resolve endpoint, read with (range) GETs.

    Redirects (the Hub sends resolve URLs to its content servers) are followed by urllib, which keeps
    the Range header and drops the token (an unredirected header) on the way. Transient failures are
    retried ``retries`` times with exponential backoff (``backoff_s``, doubled each time); a range
    whose body stopped early resumes from the first byte not yet received.
    """

    endpoint: str
    repo: str
    revision: str
    token: str | None = None
    timeout: float = 60.0
    retries: int = 4
    backoff_s: float = 1.0
    bytes_received: int = 0
    commit: str | None = None
    retried: int = 0
    requested: str = ""  # the revision asked for (a branch, tag or commit); revision becomes the commit
    fix: str = "check the network, then rerun to resume"

    def __post_init__(self) -> None:
        self.requested = self.requested or self.revision
        self.host = common.host_of(self.endpoint)

    @property
    def closed_early(self) -> str:
        return f"{self.host} closed the connection early"

    def url(self, file: str) -> str:
        return f"{self.endpoint}/{self.repo}/resolve/{quote(self.revision, safe='')}/{quote(file)}"

    def _open(self, file: str, rng: tuple[int, int] | None) -> Any:
        req = urllib.request.Request(self.url(file))
        if rng is not None:
            req.add_header("Range", f"bytes={rng[0]}-{rng[0] + rng[1] - 1}")
        if self.token:
            # unredirected: never forwarded to the CDN a resolve URL redirects to
            req.add_unredirected_header("Authorization", f"Bearer {self.token}")
        where = f"{self.repo}/{file}@{self.revision}"
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)  # noqa: S310 - https endpoint
        except urllib.error.HTTPError as exc:
            if exc.code in TRANSIENT_HTTP:
                raise TransientError(
                    f"{where}: HTTP {exc.code}", f"{self.host} answered HTTP {exc.code}"
                ) from None
            hint = " (gated or private repo: provide a token)" if exc.code in (401, 403) else ""
            raise FetchError(f"{where}: HTTP {exc.code}{hint}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            problem = common.network_problem(exc, self.host) or f"{self.host} could not be reached ({reason})"
            raise TransientError(f"{where}: {reason}", problem) from None
        named = resp.headers.get("X-Repo-Commit")
        if self.commit is None and named and COMMIT_RE.fullmatch(named):
            self.commit = named
            if self.revision != named:
                # every later request of this fetch reads the same commit, even if the branch moves
                common.log(f"{self.repo}: revision {self.revision} is commit {named}; this fetch reads that "
                           "commit")
                self.revision = named
        elif named and self.commit and named != self.commit:
            raise FetchError(f"{where}: the Hub answered from commit {named}, not {self.commit}")
        return resp

    def _retrying(self, what: Callable[[], Any]) -> Any:
        retry = Retry(self.retries, self.backoff_s, self.fix)
        try:
            return retry(what)
        finally:
            self.retried += retry.retried

    def get(self, file: str) -> bytes:
        def once() -> bytes:
            with self._open(file, None) as resp:
                try:
                    return resp.read()
                except (OSError, http.client.HTTPException) as exc:
                    problem = common.network_problem(exc, self.host) or self.closed_early
                    raise TransientError(f"{self.repo}/{file}@{self.revision}: {exc}", problem) from None

        body = self._retrying(once)
        self.bytes_received += len(body)
        return body

    def stream_range(self, file: str, offset: int, length: int, sink: Callable[[bytes], None]) -> int | None:
        """Feed exactly ``length`` bytes at ``offset`` to ``sink``; returns the remote file size.

        A body that ends early is resumed from the first missing byte (each resume that brings no
        byte counts as a failed attempt); wrong Content-Range or too many bytes are not retried."""
        got = 0
        size: int | None = None

        def once() -> None:
            nonlocal got, size
            start, want = offset + got, length - got
            where = f"{self.repo}/{file}@{self.revision} bytes {start}+{want}"
            with self._open(file, (start, want)) as resp:
                if resp.status != 206:
                    raise FetchError(f"{where}: expected HTTP 206 for a range request, got {resp.status}")
                m = CONTENT_RANGE_RE.match(resp.headers.get("Content-Range", ""))
                if m is None or int(m.group(1)) != start or int(m.group(2)) != start + want - 1:
                    raise FetchError(f"{where}: wrong Content-Range {resp.headers.get('Content-Range')!r}")
                size = int(m.group(3)) if m.group(3) != "*" else None
                before = got
                try:
                    while got < length:
                        block = resp.read(min(CHUNK, length - got))
                        if not block:
                            break
                        sink(block)
                        got += len(block)
                        self.bytes_received += len(block)
                except (OSError, http.client.HTTPException) as exc:
                    lost = f"{where}: connection lost after {got - before} bytes ({exc})"
                    problem = common.network_problem(exc, self.host) or self.closed_early
                    raise TransientError(lost, problem) from None
                if got < length:
                    early = f"{self.host} closed the connection early"
                    raise TransientError(f"{where}: short body ({got - before} of {want} bytes)", early)
                if resp.read(1):
                    raise FetchError(f"{where}: long body (more than the {want} bytes requested)")

        self._retrying(once)
        return size

    def get_range(self, file: str, offset: int, length: int) -> tuple[bytes, int | None]:
        parts: list[bytes] = []
        size = self.stream_range(file, offset, length, parts.append)
        return b"".join(parts), size


def remote_header(remote: Remote, file: str) -> Header:
    head, size = remote.get_range(file, 0, 8)
    header_len = int.from_bytes(head, "little")
    try:
        check_header_len(Path(file), header_len, size)
        raw, _ = remote.get_range(file, 8, header_len)
        return parse_header_bytes(Path(file), raw, header_len, size)
    except SafetensorsError as exc:
        raise FetchError(f"{remote.repo}/{exc}") from None


def remote_index(remote: Remote) -> dict[str, str]:
    try:
        doc = json.loads(remote.get(INDEX_NAME))
        wm = doc["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FetchError(f"{remote.repo}/{INDEX_NAME}: invalid index ({exc})") from None
    return dict(wm)


# ------------------------------------------------------------------ fp8-extract


@dataclass(frozen=True)
class Selected:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute offset in the remote file
    length: int


@dataclass
class Selection:
    tensors: list[Selected] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.length for t in self.tensors)


def wanted_weight(name: str, pattern: re.Pattern[str]) -> bool:
    return (
        name.endswith(".weight") and not is_expert(name) and not is_mtp(name) and bool(pattern.search(name))
    )


def select_tensors(remote: Remote, pattern: re.Pattern[str]) -> Selection:
    wm = remote_index(remote)
    weights = [n for n in wm if wanted_weight(n, pattern)]
    files = sorted({wm[n] for n in weights} | {wm[scale_name(n)] for n in weights if scale_name(n) in wm})
    headers = {f: remote_header(remote, f) for f in files}
    sel = Selection()
    for name in sorted(weights):
        h = headers[wm[name]]
        info = h.tensors.get(name)
        if info is None:
            raise FetchError(f"{remote.repo}/{wm[name]}: index lists {name} but the header lacks it")
        if info.dtype != FP8_DTYPE:
            sel.skipped[name] = f"dtype {info.dtype}, not {FP8_DTYPE}"
            continue
        sname = scale_name(name)
        sfile = wm.get(sname)
        sinfo = headers[sfile].tensors.get(sname) if sfile else None
        if sinfo is None:
            sel.skipped[name] = "no weight_scale_inv partner"
            continue
        for fname, t in ((wm[name], info), (sfile, sinfo)):
            off, length = headers[fname].absolute(t.name)
            sel.tensors.append(Selected(t.name, fname, t.dtype, t.shape, off, length))
    sel.tensors.sort(key=lambda t: (t.file, t.offset))
    return sel


def fetch_selection(remote: Remote, sel: Selection, dest: Path) -> Header:
    with atomic_write(dest, tag="incomplete") as out:
        out.write(encode_header(TensorSpec(t.name, t.dtype, t.shape) for t in sel.tensors))
        for file in sorted({t.file for t in sel.tensors}):
            ranges = [ByteRange(t.offset, t.length) for t in sel.tensors if t.file == file]
            for r in coalesce(ranges):
                remote.stream_range(file, r.offset, r.length, out.write)
            common.log(f"fetched {sum(x.length for x in ranges)} bytes from {file}")
        out.flush()
        header = read_header(out.name)
        if header.data_size != sel.nbytes:
            raise FetchError(f"{dest}: wrote {header.data_size} data bytes, expected {sel.nbytes}")
    return read_header(dest)


def fp8_extract(remote: Remote, dest: Path, pattern: str) -> dict[str, object]:
    if dest.is_dir():
        raise UsageError(f"{dest}: --dest is a directory; fp8-extract writes one FILE: name a file inside it")
    record_path = dest.parent / SOURCE_RECORD
    old = common.read_json(record_path)
    if dest.is_file() and old.get("repo") == remote.repo and old.get("revision") == remote.requested:
        try:
            if old.get("pattern") == pattern and read_header(dest).digest == old.get("header_sha256"):
                return {"changed": False, **old}
        except SafetensorsError:
            pass
    sel = select_tensors(remote, re.compile(pattern))
    if not sel.tensors:
        raise FetchError(f"{remote.repo}@{remote.revision}: no FP8 tensors with scales match {pattern!r}")
    # after the selection: offline, nothing is created
    common.claim_dir(dest.parent, flag="--dest's directory")
    common.check_disk_space(dest.parent, sel.nbytes + MAX_HEADER_BYTES // 100)
    header = fetch_selection(remote, sel, dest)
    write_json_atomic(
        dest.parent / INDEX_NAME,
        {"metadata": {"total_size": sel.nbytes}, "weight_map": {t.name: dest.name for t in sel.tensors}},
    )
    record = {
        "repo": remote.repo,
        "revision": remote.requested,
        "commit": remote.commit,
        "mode": "fp8-extract",
        "pattern": pattern,
        "file": dest.name,
        "tensors": len(sel.tensors),
        "bytes": sel.nbytes,
        "header_sha256": header.digest,
        "skipped": sel.skipped,
        "fetched_at": int(time.time()),
    }
    write_json_atomic(record_path, record)
    return {"changed": True, **record}
