#!/usr/bin/env python3
"""Fetch checkpoints from the Hugging Face Hub or a local mirror, verified.

Subcommands:
  hub --repo R --revision REV --dest DIR [--include GLOB ...] [--token-file F] [--endpoint URL]
      Download files of a Hub repo (huggingface_hub, resumable, progress) and verify each file's
      size and sha256 (git blob sha1 for small non-LFS files) against the Hub's file metadata.
  full --repo R --revision REV --dest DIR [...]
      `hub` for the whole FP8 checkpoint (*.safetensors shards + *.json), sha256-verified.
  fp8-extract --repo R --revision REV --dest FILE [--pattern REGEX] [--token-file F] [--endpoint URL]
      Read the FP8 checkpoint's index and shard headers remotely with HTTP Range requests on
      {endpoint}/{repo}/resolve/{revision}/{file}, select the non-expert F8_E4M3 weights whose name
      matches --pattern (default "shared_expert"; mtp.* excluded) and their *.weight_scale_inv
      partners, fetch only those byte ranges (coalesced; each response must be 206 with exactly the
      requested range and length) and write FILE atomically, plus model.safetensors.index.json and
      .sparkllm_source.json (provenance) next to it.
  mirror --src DIR --dest DIR [--max-rate BYTES_PER_S]
      Copy from a local/mounted mirror, verifying every file against the mirror's
      sparkllm-manifest.json (name, size, sha256). Temp file + rename per file. --max-rate caps the
      read rate (a shared NAS or link; default: unlimited).
  manifest DIR [--no-sha256]
      Write DIR/sparkllm-manifest.json for use as a mirror.

Every mode checks free disk space before transferring (needed bytes + 1 GiB/2 % margin).
Token: --token-file F or the HF_TOKEN environment variable; it is sent only as an Authorization
header and never printed or written. Endpoint: --endpoint, else HF_ENDPOINT, else
https://huggingface.co. A finished destination is recorded in DIR/.sparkllm_source.json; reruns
skip files that are already complete and verified. Each file is recorded as verified the moment it
is (hub/full: "verified" in .sparkllm_source.json; mirror: .sparkllm_mirror.json), with its size and
mtime: `verified_files(DIR)` reads that, so a consumer (scripts/model_job.py) can use a file while the
rest is still arriving.

Destinations are ours or untouched: a destination directory is marked (.sparkllm-owner.json) when
this tool creates it; a non-empty directory it did not create, an existing file where a directory
belongs (or a directory where fp8-extract's FILE belongs), and a mirror destination equal to, inside or
holding --src are refused before anything is written.

Exit codes: 0 ok, 1 failure (message names the file and the problem), 2 usage error (bad arguments,
missing --token-file or --src, a destination the tool may not write).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import http.client
import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from sparkllm.checkpoint import (
    FP8_DTYPE,
    MANIFEST_NAME,
    SOURCE_RECORD,
    CheckpointError,
    ManifestEntry,
    build_manifest,
    is_expert,
    is_mtp,
    manifest_doc,
    read_manifest,
    scale_name,
)
from sparkllm.cli import HelpFormatter
from sparkllm.fileio import Throttle, atomic_write, fsync_dir, sha256_file, write_json_atomic
from sparkllm.outdir import OutputRefused, check_output_dir, write_marker
from sparkllm.safetensors_io import (
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

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20
MARGIN_BYTES = 1 << 30
MARGIN_FRACTION = 0.02
CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")
TOOL = "fetch_checkpoint"
MIRROR_STATE = ".sparkllm_mirror.json"
# bookkeeping files that mark a destination written by an earlier version of this tool
LEGACY_MARKS = (SOURCE_RECORD, MIRROR_STATE)


class FetchError(Exception):
    """A download or verification failed; the message names the file and the problem."""


class UsageError(Exception):
    """The command line is wrong (exit 2); the message names the problem and the fix."""


def claim_dir(dest: Path, inputs: tuple[tuple[str, Path], ...] = (), flag: str = "--dest") -> None:
    """Refuse a destination that is not ours (UsageError), else create it and mark it as ours."""
    try:
        check_output_dir(dest, TOOL, inputs=inputs, flag=flag, legacy=LEGACY_MARKS)
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    dest.mkdir(parents=True, exist_ok=True)
    write_marker(dest, TOOL)


# ------------------------------------------------------------------ shared helpers


def read_token(token_file: Path | None) -> str | None:
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise UsageError(
                f"{token_file}: cannot read --token-file ({exc.strerror}); "
                "pass a readable file holding the token"
            ) from None
        if not token:
            raise FetchError(f"{token_file}: token file is empty")
        return token
    return os.environ.get("HF_TOKEN") or None


def endpoint_of(arg: str | None) -> str:
    return (arg or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_disk_space(dest_dir: Path, needed: int) -> None:
    """Refuse when ``needed`` bytes plus a margin do not fit on ``dest_dir``'s filesystem."""
    probe = dest_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    want = needed + MARGIN_BYTES + int(needed * MARGIN_FRACTION)
    if needed > 0 and want > free:
        raise FetchError(
            f"{dest_dir}: not enough disk space: need {gib(want)} ({gib(needed)} + margin), "
            f"{gib(free)} free; free up space or choose a --dest on a larger filesystem"
        )


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(CHUNK * 4):
            h.update(block)
    return h.hexdigest()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ remote (HTTP Range) access


COMMIT_RE = re.compile(r"[0-9a-f]{40}")
TRANSIENT_HTTP = (408, 425, 429, 500, 502, 503, 504)


class TransientError(FetchError):
    """A failure worth another try: a 5xx/429 answer, a reset or timed-out connection, a body that
    stopped early."""


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

    def __post_init__(self) -> None:
        self.requested = self.requested or self.revision

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
                raise TransientError(f"{where}: HTTP {exc.code}") from None
            hint = " (gated or private repo: provide a token)" if exc.code in (401, 403) else ""
            raise FetchError(f"{where}: HTTP {exc.code}{hint}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise TransientError(f"{where}: {getattr(exc, 'reason', exc)}") from None
        named = resp.headers.get("X-Repo-Commit")
        if self.commit is None and named and COMMIT_RE.fullmatch(named):
            self.commit = named
            if self.revision != named:
                # every later request of this fetch reads the same commit, even if the branch moves
                log(f"{self.repo}: revision {self.revision} is commit {named}; this fetch reads that commit")
                self.revision = named
        elif named and self.commit and named != self.commit:
            raise FetchError(f"{where}: the Hub answered from commit {named}, not {self.commit}")
        return resp

    def _retrying(self, what: Callable[[], Any]) -> Any:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return what()
            except TransientError as exc:
                if attempt == self.retries:
                    raise FetchError(f"{exc} (gave up after {self.retries + 1} attempts)") from None
                self.retried += 1
                log(f"transient: {exc}; retrying in {delay:g} s ({self.retries - attempt} left)")
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def get(self, file: str) -> bytes:
        def once() -> bytes:
            with self._open(file, None) as resp:
                try:
                    return resp.read()
                except (OSError, http.client.HTTPException) as exc:
                    raise TransientError(f"{self.repo}/{file}@{self.revision}: {exc}") from None

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
                    raise TransientError(lost) from None
                if got < length:
                    raise TransientError(f"{where}: short body ({got - before} of {want} bytes)")
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
            log(f"fetched {sum(x.length for x in ranges)} bytes from {file}")
        out.flush()
        header = read_header(out.name)
        if header.data_size != sel.nbytes:
            raise FetchError(f"{dest}: wrote {header.data_size} data bytes, expected {sel.nbytes}")
    return read_header(dest)


def fp8_extract(remote: Remote, dest: Path, pattern: str) -> dict[str, object]:
    if dest.is_dir():
        raise UsageError(f"{dest}: --dest is a directory; fp8-extract writes one FILE: name a file inside it")
    claim_dir(dest.parent, flag="--dest's directory")
    record_path = dest.parent / SOURCE_RECORD
    old = _read_json(record_path)
    if dest.is_file() and old.get("repo") == remote.repo and old.get("revision") == remote.requested:
        try:
            if old.get("pattern") == pattern and read_header(dest).digest == old.get("header_sha256"):
                return {"changed": False, **old}
        except SafetensorsError:
            pass
    sel = select_tensors(remote, re.compile(pattern))
    if not sel.tensors:
        raise FetchError(f"{remote.repo}@{remote.revision}: no FP8 tensors with scales match {pattern!r}")
    check_disk_space(dest.parent, sel.nbytes + MAX_HEADER_BYTES // 100)
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


# ------------------------------------------------------------------ hub (huggingface_hub)


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files
    blob_sha1: str | None  # git blob id (non-LFS files)


class HubClient(Protocol):
    def list_files(self) -> list[RemoteFile]: ...
    def download(self, name: str, dest_dir: Path) -> Path: ...
    def commit(self) -> str | None: ...


@dataclass
class HfHubClient:
    """huggingface_hub-backed client (imported lazily; only hub/full modes need it)."""

    repo: str
    revision: str
    endpoint: str
    token: str | None

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token)

    def pin(self) -> str:
        """Resolve a branch or tag to its commit once, so every later call of this fetch reads that
        commit (a push during a long download cannot splice two commits)."""
        if not COMMIT_RE.fullmatch(self.revision):
            sha = getattr(self._api().model_info(self.repo, revision=self.revision), "sha", None)
            if not sha or not COMMIT_RE.fullmatch(sha):
                raise FetchError(f"{self.repo}@{self.revision}: the Hub did not name the commit ({sha!r})")
            log(f"{self.repo}: revision {self.revision} is commit {sha}; this fetch reads that commit")
            self.revision = sha
        return self.revision

    def list_files(self) -> list[RemoteFile]:
        self.pin()
        api = self._api()
        names = api.list_repo_files(self.repo, revision=self.revision)
        out = []
        for info in api.get_paths_info(self.repo, names, revision=self.revision, expand=True):
            if getattr(info, "size", None) is None:
                continue  # folders
            lfs = getattr(info, "lfs", None)
            out.append(
                RemoteFile(info.path, info.size, lfs.sha256 if lfs else None, getattr(info, "blob_id", None))
            )
        return out

    def download(self, name: str, dest_dir: Path) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(
            hf_hub_download(
                self.repo,
                name,
                revision=self.revision,
                local_dir=dest_dir,
                token=self.token,
                endpoint=self.endpoint,
            )
        )

    def commit(self) -> str | None:
        return self.pin()


def verify_file(path: Path, rf: RemoteFile) -> None:
    size = path.stat().st_size
    if size != rf.size:
        raise FetchError(f"{path}: size {size} != Hub size {rf.size}")
    if rf.sha256 and sha256_file(path) != rf.sha256:
        raise FetchError(
            f"{path}: sha256 differs from the Hub's ({rf.sha256}); file deleted, rerun to refetch"
        )
    if not rf.sha256 and rf.blob_sha1 and git_blob_sha1(path) != rf.blob_sha1:
        raise FetchError(f"{path}: git blob id differs from the Hub's ({rf.blob_sha1}); file deleted, rerun")


def hub_fetch(
    client: HubClient, repo: str, revision: str, dest: Path, include: list[str]
) -> dict[str, object]:
    files = [
        f for f in client.list_files() if not include or any(fnmatch.fnmatch(f.name, g) for g in include)
    ]
    if not files:
        raise FetchError(f"{repo}@{revision}: no files match {include}")
    claim_dir(dest)
    record_path = dest / SOURCE_RECORD
    record = _read_json(record_path)
    commit = client.commit()  # listing pinned the revision: no extra request
    # Files verified earlier count when they were read from the same revision, or from the same commit
    # under another name (the branch a first fetch named, and the commit SHA a locked rerun names).
    same = record.get("revision") == revision or (commit is not None and record.get("commit") == commit)
    verified: dict[str, Any] = record.get("verified", {}) if same else {}

    def done(rf: RemoteFile) -> bool:
        p = dest / rf.name
        v = verified.get(rf.name)
        return (
            p.is_file()
            and isinstance(v, dict)
            and v.get("size") == rf.size == p.stat().st_size
            and v.get("mtime_ns") == p.stat().st_mtime_ns
        )

    todo = [f for f in files if not done(f)]
    check_disk_space(dest, sum(f.size for f in todo))
    for k, rf in enumerate(todo, 1):
        log(f"[{k}/{len(todo)}] {repo}/{rf.name} ({gib(rf.size)})")
        path = client.download(rf.name, dest)
        try:
            verify_file(path, rf)
        except FetchError:
            path.unlink(missing_ok=True)
            raise
        verified[rf.name] = {"size": rf.size, "sha256": rf.sha256, "mtime_ns": path.stat().st_mtime_ns}
        write_json_atomic(
            record_path, {"repo": repo, "revision": revision, "commit": commit, "verified": verified}
        )
    out = {"repo": repo, "revision": revision, "commit": commit, "mode": "hub", "verified": verified}
    write_json_atomic(record_path, out)
    return {"changed": bool(todo), "files": len(files), "downloaded": len(todo), "commit": commit}


# ------------------------------------------------------------------ mirror


def verified_files(dest: Path) -> dict[str, int]:
    """Files of ``dest`` this tool has verified and that are still as verified (size and mtime):
    name -> size. Read while a fetch runs, it lists the files that are complete already."""
    mirror = _read_json(dest / MIRROR_STATE)
    hub = _read_json(dest / SOURCE_RECORD).get("verified", {})
    out: dict[str, int] = {}
    for states in (hub if isinstance(hub, dict) else {}, mirror):
        for name, st in states.items():
            if not isinstance(st, dict):
                continue
            try:
                cur = (dest / name).stat()
            except OSError:
                continue
            if st.get("size") == cur.st_size and st.get("mtime_ns") == cur.st_mtime_ns:
                out[name] = cur.st_size
    return out


def copy_verified(src: Path, dst: Path, entry: ManifestEntry, throttle: Throttle | None = None) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
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


def mirror_fetch(src: Path, dest: Path, max_rate: float = 0) -> dict[str, object]:
    if not src.is_dir():
        raise UsageError(
            f"{src}: --src is not a directory; pass the mirror directory (holding {MANIFEST_NAME})"
        )
    try:
        check_output_dir(dest, TOOL, inputs=(("--src", src),), flag="--dest", legacy=LEGACY_MARKS)
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    manifest_path = src / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FetchError(
            f"{manifest_path}: mirror manifest missing; create it with `fetch_checkpoint.py manifest {src}`"
        )
    try:
        entries = read_manifest(manifest_path)
    except CheckpointError as exc:
        raise FetchError(str(exc)) from None
    claim_dir(dest, inputs=(("--src", src),))
    record_path = dest / SOURCE_RECORD
    record = _read_json(src / SOURCE_RECORD)
    state = _read_json(dest / MIRROR_STATE)

    def done(e: ManifestEntry) -> bool:
        p = dest / e.name
        s = state.get(e.name)
        return (
            p.is_file()
            and isinstance(s, dict)
            and s.get("sha256") == e.sha256
            and (s.get("size") == e.size == p.stat().st_size and s.get("mtime_ns") == p.stat().st_mtime_ns)
        )

    todo = [e for e in entries if not done(e)]
    for e in todo:
        if not (src / e.name).is_file():
            raise FetchError(f"{src / e.name}: listed in {MANIFEST_NAME} but missing from the mirror")
    check_disk_space(dest, sum(e.size for e in todo))
    throttle = Throttle(max_rate)
    for e in todo:
        log(f"mirror: {e.name} ({gib(e.size)})")
        copy_verified(src / e.name, dest / e.name, e, throttle)
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


# ------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fetch_checkpoint.py",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=HelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def remote_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--repo", required=True, help="Hub repo id, e.g. Qwen/Qwen3.5-122B-A10B-FP8")
        sp.add_argument("--revision", required=True, help="pinned revision (commit sha preferred)")
        sp.add_argument(
            "--token-file", type=Path, help="file holding the HF token (default: $HF_TOKEN, else no token)"
        )
        sp.add_argument(
            "--endpoint", help="Hub endpoint (default: $HF_ENDPOINT, else https://huggingface.co)"
        )

    for name, helptext in (
        ("hub", "download repo files via huggingface_hub"),
        ("full", "whole FP8 checkpoint"),
    ):
        sp = sub.add_parser(name, help=helptext, formatter_class=HelpFormatter)
        remote_args(sp)
        sp.add_argument("--dest", required=True, type=Path, help="destination directory")
        sp.add_argument(
            "--include",
            nargs="*",
            default=[],
            metavar="GLOB",
            help="only files matching these globs (default: every file; `full`: *.safetensors *.json)",
        )
    sp = sub.add_parser(
        "fp8-extract",
        help="range-fetch the FP8 shared-expert tensors into one small file",
        formatter_class=HelpFormatter,
    )
    remote_args(sp)
    sp.add_argument("--retries", type=int, default=4,
                    help="retries of a transient failure (5xx, 429, lost connection) per request (default 4)")
    sp.add_argument("--retry-backoff-s", type=float, default=1.0,
                    help="first wait before a retry in seconds, doubled each time (default 1.0)")
    sp.add_argument("--dest", required=True, type=Path, help="destination safetensors FILE")
    sp.add_argument(
        "--pattern", default="shared_expert", help="regex on tensor names"
    )
    sp = sub.add_parser(
        "mirror",
        help="copy from a mirror directory verified against its manifest",
        formatter_class=HelpFormatter,
    )
    sp.add_argument("--src", required=True, type=Path, help="mirror directory holding sparkllm-manifest.json")
    sp.add_argument("--dest", required=True, type=Path, help="destination directory")
    sp.add_argument("--max-rate", type=float, default=0, metavar="BYTES_PER_S",
                    help="read at most this many bytes per second from the mirror (default 0: unlimited)")
    sp = sub.add_parser(
        "manifest", help="write sparkllm-manifest.json for a directory", formatter_class=HelpFormatter
    )
    sp.add_argument("dir", type=Path, help="checkpoint directory to describe")
    sp.add_argument(
        "--no-sha256", action="store_true", help="sizes only (fast, weaker; default: with sha256)"
    )
    return p


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(a: argparse.Namespace) -> dict[str, object]:
    if a.cmd == "manifest":
        return write_manifest(a.dir, not a.no_sha256)
    if a.cmd == "mirror":
        if a.max_rate < 0:
            raise UsageError(f"--max-rate {a.max_rate:g}: must be 0 (unlimited) or a positive rate")
        return mirror_fetch(a.src, a.dest, a.max_rate)
    # refuse a destination that is not ours before any network traffic
    if a.cmd == "fp8-extract":
        if a.dest.is_dir():
            raise UsageError(
                f"{a.dest}: --dest is a directory; fp8-extract writes one FILE: name a file inside it"
            )
        out_dir, flag = a.dest.parent, "--dest's directory"
    else:
        out_dir, flag = a.dest, "--dest"
    try:
        check_output_dir(out_dir, TOOL, flag=flag, legacy=LEGACY_MARKS)
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    token = read_token(a.token_file)
    endpoint = endpoint_of(a.endpoint)
    if a.cmd == "fp8-extract":
        remote = Remote(endpoint, a.repo, a.revision, token, retries=max(0, a.retries),
                        backoff_s=max(0.0, a.retry_backoff_s))
        return fp8_extract(remote, a.dest, a.pattern)
    include = a.include or (["*.safetensors", "*.json"] if a.cmd == "full" else [])
    client = HfHubClient(a.repo, a.revision, endpoint, token)
    return hub_fetch(client, a.repo, a.revision, a.dest, include)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except UsageError as exc:
        print(f"fetch_checkpoint: error: {exc}", file=sys.stderr)
        return 2
    except (FetchError, CheckpointError, SafetensorsError, OSError) as exc:
        print(f"fetch_checkpoint: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
