"""What every mode of fetch_checkpoint.py shares (standard library only): errors, retries, the network
problem in one phrase, destinations (claimed, refused, cleaned up after a failure), disk space, token.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import ssl
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..checkpoint.hybrid import SOURCE_RECORD
from ..checkpoint.safetensors_io import INDEX_NAME
from ..cli import UsageError
from ..outdir import MARKER, OutputRefused, check_output_dir, marker_tool, write_marker

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20
MARGIN_BYTES = 1 << 30
MARGIN_FRACTION = 0.02
TOOL = "fetch_checkpoint"
MIRROR_STATE = ".sparkllm_mirror.json"
# bookkeeping files that mark a destination written by an earlier version of this tool
LEGACY_MARKS = (SOURCE_RECORD, MIRROR_STATE)
# what a destination holds that is not a checkpoint file: removed with a directory this run created
BOOKKEEPING = (MARKER, SOURCE_RECORD, MIRROR_STATE, INDEX_NAME)
HF_CACHE = ".cache"  # huggingface_hub's local_dir bookkeeping and partial downloads (.cache/huggingface)
TRANSIENT_HTTP = (408, 425, 429, 500, 502, 503, 504)
T = TypeVar("T")


class FetchError(Exception):
    """A download or verification failed; the message names the file and the problem."""


class TransientError(FetchError):
    """A failure worth another try: a network problem (``problem`` says which, in one phrase), a
    5xx/429 answer, a body that stopped early."""

    def __init__(self, msg: str, problem: str = "") -> None:
        super().__init__(msg)
        self.problem = problem or msg


class NetworkError(FetchError):
    """Transient failures outlasted every retry; ``str()`` is one line naming the host problem."""

    def __init__(self, last: TransientError, attempts: int, seconds: float, fix: str) -> None:
        super().__init__(
            f"{last.problem} ({last}); gave up after {attempts} attempts over {seconds:.0f} s; {fix}"
        )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


# ------------------------------------------------------------------ network problems in one phrase

DNS_WORDS = (
    "name or service not known",
    "temporary failure in name resolution",
    "nodename nor servname",
    "no address associated",
    "name resolution",
    "getaddrinfo failed",
)
WORDS = (
    (DNS_WORDS, "the host name {host} does not resolve (DNS failure)"),
    (("connection refused",), "{host} refused the connection (nothing listens there)"),
    (("connection reset", "broken pipe", "connection aborted"), "{host} reset the connection"),
    (("timed out", "timeout"), "{host} did not answer in time (timed out)"),
    (("network is unreachable", "no route to host", "host is unreachable"), "{host} is unreachable"),
    (("server disconnected", "peer closed", "incomplete chunked read", "remoteprotocolerror",
      "connection lost", "short body"), "{host} closed the connection early"),
)  # fmt: skip
UNREACHABLE = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def network_problem(exc: BaseException, host: str) -> str | None:
    """The network problem behind ``exc`` (its cause chain: urllib's, httpx's or huggingface_hub's
    wrappers around a socket error) in one phrase naming ``host``, or None when it is not one."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, socket.gaierror):
            return f"the host name {host} does not resolve (DNS failure: {e.strerror or e})"
        if isinstance(e, ConnectionRefusedError):
            return f"{host} refused the connection (nothing listens there)"
        if isinstance(e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
            return f"{host} reset the connection"
        if isinstance(e, TimeoutError):
            return f"{host} did not answer in time (timed out)"
        if isinstance(e, ssl.SSLError):
            return f"TLS with {host} failed ({e.reason or e})"
        if isinstance(e, OSError) and e.errno in UNREACHABLE:
            return f"{host} is unreachable ({e.strerror})"
    text = " ".join(f"{type(e).__name__} {e}" for e in chain).lower()
    for words, phrase in WORDS:
        if any(w in text for w in words):
            return phrase.format(host=host)
    return None


@dataclass
class Retry:
    """``retries`` more tries of a TransientError, waiting ``backoff_s`` then doubling; then a
    NetworkError whose message ends with ``fix``."""

    retries: int = 4
    backoff_s: float = 1.0
    fix: str = "check the network, then rerun to resume"
    retried: int = 0

    def __call__(self, what: Callable[[], T]) -> T:
        delay, start = self.backoff_s, time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                return what()
            except TransientError as exc:
                if attempt == self.retries:
                    raise NetworkError(exc, attempt + 1, time.monotonic() - start, self.fix) from None
                self.retried += 1
                left = self.retries - attempt
                log(f"transient: {exc.problem} ({exc}); retrying in {delay:g} s ({left} left)")
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")


# ------------------------------------------------------------------ destinations


@dataclass
class Created:
    """The directories (and ownership markers) this run created, so a failed or interrupted run can
    remove them again."""

    dirs: list[Path]
    markers: list[Path] = field(default_factory=list)  # directories that were there, marked this run

    def cleanup(self) -> list[Path]:
        """Remove each directory this run created that holds nothing a rerun would reuse (only our
        bookkeeping and temporary files), and the marker this run put in an existing directory that
        still holds nothing; keep the others. Returns the kept directories."""
        for d in self.markers:
            if d.is_dir() and not has_progress(d) and not (d / SOURCE_RECORD).exists():
                (d / MARKER).unlink(missing_ok=True)
        self.markers.clear()
        kept = []
        for d in reversed(self.dirs):
            if not d.is_dir():
                continue
            if has_progress(d):
                kept.append(d)
                continue
            for name in BOOKKEEPING:
                (d / name).unlink(missing_ok=True)
            shutil.rmtree(d / HF_CACHE, ignore_errors=True)
            for p in d.glob(".*"):
                if ".incomplete-" in p.name or ".tmp-" in p.name:
                    p.unlink(missing_ok=True)
            try:
                d.rmdir()  # fails (and keeps it) when anything else is in it
            except OSError:
                kept.append(d)
        self.dirs.clear()
        return kept


CREATED = Created([])


def has_progress(d: Path) -> bool:
    """True when ``d`` holds something a rerun reuses: a checkpoint file, a partial Hub download."""
    try:
        names = [p.name for p in d.iterdir()]
    except OSError:
        return True
    for name in names:
        if name in BOOKKEEPING or ".incomplete-" in name or ".tmp-" in name:
            continue
        if name == HF_CACHE:
            if any(p.suffix == ".incomplete" and p.stat().st_size for p in (d / HF_CACHE).rglob("*")):
                return True
            continue
        return True
    return False


def check_parent(dest: Path, flag: str) -> None:
    """Refuse a destination whose parent is not an existing directory (nothing is created)."""
    parent = dest.absolute().parent
    if parent.is_dir():
        return
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(
            f"{dest}: {flag}'s parent {probe} is a file, not a directory; choose a {flag} under a directory"
        )
    raise UsageError(
        f"{dest}: {flag}'s parent {parent} does not exist; create it first (mkdir -p {parent}) "
        f"or choose a {flag} under an existing directory"
    )


def refuse_output(dest: Path, flag: str, inputs: tuple[tuple[str, Path], ...] = ()) -> None:
    """Refuse a destination that is not ours, or whose parent does not exist (UsageError)."""
    check_parent(dest, flag)
    try:
        check_output_dir(dest, TOOL, inputs=inputs, flag=flag, legacy=LEGACY_MARKS)
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None


def claim_dir(dest: Path, inputs: tuple[tuple[str, Path], ...] = (), flag: str = "--dest") -> None:
    """Refuse a destination that is not ours (UsageError), else create it (noted in CREATED) and mark
    it as ours."""
    refuse_output(dest, flag, inputs)
    existed = dest.is_dir()
    make_dir(dest, flag)
    if existed and marker_tool(dest) != TOOL:
        CREATED.markers.append(dest)
    write_marker(dest, TOOL)


def make_dir(d: Path, flag: str = "--dest") -> None:
    """Create ``d`` (one level; its parent exists) unless it is there, noting it in CREATED."""
    if d.is_dir():
        return
    try:
        d.mkdir()
    except OSError as exc:
        raise UsageError(f"{d}: cannot create {flag} ({exc.strerror}); choose a writable place") from None
    CREATED.dirs.append(d)


def read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def still_verified(path: Path, rec: object, size: int | None = None) -> bool:
    """True when ``rec``, what was recorded the moment ``path`` was verified, still describes it: a
    regular file of the recorded size and mtime (and of ``size``, the size expected, when given)."""
    if not isinstance(rec, dict):
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    same = rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns
    return stat.S_ISREG(st.st_mode) and same and size in (None, st.st_size)


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


# ------------------------------------------------------------------ token, endpoint, hashes


def read_token(token_file: Path | None) -> str | None:
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or "not text"
            raise UsageError(
                f"{token_file}: cannot read --token-file ({why}); pass a readable file holding the token"
            ) from None
        if not token:
            raise UsageError(f"{token_file}: --token-file is empty; write the Hub token into it")
        return token
    return os.environ.get("HF_TOKEN") or None


def endpoint_of(arg: str | None) -> str:
    source = "--endpoint" if arg else "HF_ENDPOINT"
    url = (arg or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{source} {url!r}: not an http(s) URL; give e.g. {DEFAULT_ENDPOINT}")
    return url


def host_of(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.netloc or url


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(CHUNK * 4):
            h.update(block)
    return h.hexdigest()
