"""hub and full: a Hub repo's files downloaded with huggingface_hub (imported lazily: only these modes
need it, run with the venv spark_tools creates), each verified against the Hub's metadata.

huggingface_hub raises its own exceptions (httpx's transport errors, HfHubHTTPError, and
LocalEntryNotFoundError wrapping a failed HEAD); ``hub_error`` maps them to a TransientError (retried)
or a FetchError (one line naming the problem and the fix).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..checkpoint.hybrid import SOURCE_RECORD
from ..fileio import sha256_file, write_json_atomic
from . import common
from .common import TRANSIENT_HTTP, FetchError, Retry, TransientError, UsageError
from .remote import COMMIT_RE

T = TypeVar("T")
TOKEN_HINT = "check --repo, or give a token (--token-file or HF_TOKEN) if the repo is private or gated"


def _status(e: BaseException) -> int | None:
    resp = getattr(e, "response", None)
    code = getattr(resp, "status_code", None)
    return code if isinstance(code, int) else None


def hub_error(exc: Exception, where: str, host: str) -> FetchError | UsageError:
    """The FetchError (or TransientError, retried) that says what ``exc`` from huggingface_hub means."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not x for x in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    names = [{c.__name__ for c in type(x).__mro__} for x in chain]
    for x, mro in zip(chain, names, strict=True):
        if "OfflineModeIsEnabled" in mro:
            return FetchError(
                f"{where}: HF_HUB_OFFLINE is set, so huggingface_hub sends no request; unset it"
            )
        if "HFValidationError" in mro:
            return UsageError(f"{where}: {x}; give --repo as owner/name")
        if "GatedRepoError" in mro or "RepositoryNotFoundError" in mro:
            return FetchError(
                f"{where}: repository not found, private or gated (HTTP {_status(x)}); {TOKEN_HINT}"
            )
        if "RevisionNotFoundError" in mro:
            return FetchError(f"{where}: revision not found on the Hub; check --revision")
        if "RemoteEntryNotFoundError" in mro:
            return FetchError(f"{where}: file not found on the Hub at this revision")
        if "HfHubHTTPError" in mro and _status(x) is not None:
            code = _status(x)
            if code in TRANSIENT_HTTP:
                return TransientError(f"{where}: HTTP {code}", f"{host} answered HTTP {code}")
            hint = f" ({TOKEN_HINT})" if code in (401, 403) else ""
            return FetchError(f"{where}: HTTP {code}{hint}")
    problem = common.network_problem(exc, host)
    if problem is not None:
        return TransientError(f"{where}: {type(exc).__name__}: {exc}", problem)
    first = str(exc).splitlines()[0] if str(exc) else ""
    return FetchError(f"{where}: {type(exc).__name__}: {first}")


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
    retry: Retry = field(default_factory=Retry)

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn`` (a huggingface_hub call), retried on network problems; its errors as ours."""
        where = f"{self.repo}@{self.revision}: {what}"

        def once() -> T:
            try:
                return fn()
            except ImportError as exc:
                raise FetchError(
                    f"hub and full need huggingface_hub ({exc}); run this with the venv's python "
                    "(spark_tools creates /opt/sparkllm/venv) or pip install huggingface_hub"
                ) from None
            except Exception as exc:  # noqa: BLE001 - huggingface_hub's and httpx's own types
                raise hub_error(exc, where, common.host_of(self.endpoint)) from None

        return self.retry(once)

    def pin(self) -> str:
        """Resolve a branch or tag to its commit once, so every later call of this fetch reads that
        commit (a push during a long download cannot splice two commits)."""
        if not COMMIT_RE.fullmatch(self.revision):
            info = self._call(
                "resolving the revision", lambda: self._api().model_info(self.repo, revision=self.revision)
            )
            sha = getattr(info, "sha", None)
            if not sha or not COMMIT_RE.fullmatch(sha):
                raise FetchError(f"{self.repo}@{self.revision}: the Hub did not name the commit ({sha!r})")
            common.log(f"{self.repo}: revision {self.revision} is commit {sha}; this fetch reads that commit")
            self.revision = sha
        return self.revision

    def list_files(self) -> list[RemoteFile]:
        self.pin()
        api = self._api()
        names = self._call("listing files", lambda: api.list_repo_files(self.repo, revision=self.revision))
        infos = self._call(
            "reading file metadata",
            lambda: list(api.get_paths_info(self.repo, names, revision=self.revision, expand=True)),
        )
        out = []
        for info in infos:
            if getattr(info, "size", None) is None:
                continue  # folders
            lfs = getattr(info, "lfs", None)
            out.append(
                RemoteFile(info.path, info.size, lfs.sha256 if lfs else None, getattr(info, "blob_id", None))
            )
        return out

    def download(self, name: str, dest_dir: Path) -> Path:
        def fetch() -> str:
            from huggingface_hub import hf_hub_download

            # a partial download (dest_dir/.cache/huggingface) resumes, within this run and the next
            return hf_hub_download(
                self.repo, name, revision=self.revision, local_dir=dest_dir, token=self.token,
                endpoint=self.endpoint,
            )  # fmt: skip

        return Path(self._call(f"downloading {name}", fetch))

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
    if not rf.sha256 and rf.blob_sha1 and common.git_blob_sha1(path) != rf.blob_sha1:
        raise FetchError(f"{path}: git blob id differs from the Hub's ({rf.blob_sha1}); file deleted, rerun")


def hub_fetch(
    client: HubClient, repo: str, revision: str, dest: Path, include: list[str]
) -> dict[str, object]:
    files = [
        f for f in client.list_files() if not include or any(fnmatch.fnmatch(f.name, g) for g in include)
    ]
    if not files:
        raise FetchError(f"{repo}@{revision}: no files match {include}")
    common.claim_dir(dest)
    record_path = dest / SOURCE_RECORD
    record = common.read_json(record_path)
    commit = client.commit()  # listing pinned the revision: no extra request
    # Files verified earlier count when they were read from the same revision, or from the same commit
    # under another name (the branch a first fetch named, and the commit SHA a locked rerun names).
    same = record.get("revision") == revision or (commit is not None and record.get("commit") == commit)
    verified: dict[str, Any] = record.get("verified", {}) if same else {}

    todo = [f for f in files if not common.still_verified(dest / f.name, verified.get(f.name), f.size)]
    common.check_disk_space(dest, sum(f.size for f in todo))
    for k, rf in enumerate(todo, 1):
        common.log(f"[{k}/{len(todo)}] {repo}/{rf.name} ({common.gib(rf.size)})")
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
