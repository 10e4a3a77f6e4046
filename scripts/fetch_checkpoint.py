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
belongs (or a directory where fp8-extract's FILE belongs), a mirror destination equal to, inside or
holding --src, and a destination whose parent directory does not exist (the tool creates one level:
--dest, or fp8-extract's FILE's directory) are refused before anything is written.

Network problems (DNS failure, connection refused or reset, timeouts, 5xx/429 answers; for a mirror:
a timed-out, stale or disconnected mount) are retried --retries times with exponential backoff
(--retry-backoff-s, doubled each time), then end in one line naming the host and the problem and
the command whose rerun resumes. A failed or interrupted fetch keeps every file it verified (the
rerun resumes there) and removes what it created that a rerun would not reuse: temporary files, and
a destination directory it created that holds no verified file (or partial Hub download); it never
removes what it did not create.

Exit codes: 0 ok, 1 failure (one line naming the file or host and the problem), 2 usage error (bad
arguments, an unreadable or empty --token-file, a --src without its manifest, a destination the tool
may not write), 130 interrupted by Ctrl-C (SIGINT), 143 stopped by SIGTERM: one line, state resumable.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

from sparkllm.checkpoint.hybrid import CheckpointError
from sparkllm.checkpoint.safetensors_io import SafetensorsError
from sparkllm.cli import (
    EXIT_FAILED,
    EXIT_USAGE,
    Interrupted,
    doc_parser,
    say_error,
    signal_exit,
    sigterm_unwinds,
    subcommands,
)
from sparkllm.fetch.common import (
    CREATED,
    TOOL,
    FetchError,
    NetworkError,
    Retry,
    UsageError,
    check_disk_space,
    claim_dir,
    endpoint_of,
    git_blob_sha1,
    read_token,
    refuse_output,
)
from sparkllm.fetch.hub import HfHubClient, HubClient, RemoteFile, hub_fetch, verify_file
from sparkllm.fetch.mirror import copy_verified, mirror_fetch, verified_files, write_manifest
from sparkllm.fetch.remote import Remote, fp8_extract, select_tensors

__all__ = [
    "FetchError", "HfHubClient", "HubClient", "NetworkError", "Remote", "RemoteFile", "UsageError",
    "check_disk_space", "claim_dir", "copy_verified", "fp8_extract", "git_blob_sha1", "hub_fetch",
    "mirror_fetch", "read_token", "select_tensors", "verified_files", "verify_file", "write_manifest",
]  # fmt: skip
REPO_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("fetch_checkpoint.py", __doc__)
    add = subcommands(p)

    def retry_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--retries",
            type=int,
            default=4,
            help="retries of a network problem (DNS, refused, reset, timeout, 5xx, 429; for a "
            "mirror: a failing mount) per request (default 4)",
        )
        sp.add_argument(
            "--retry-backoff-s",
            type=float,
            default=1.0,
            help="first wait before a retry in seconds, doubled each time (default 1.0)",
        )

    def remote_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--repo", required=True, help="Hub repo id, e.g. Qwen/Qwen3.5-122B-A10B-FP8")
        sp.add_argument("--revision", required=True, help="pinned revision (commit sha preferred)")
        sp.add_argument(
            "--token-file", type=Path, help="file holding the HF token (default: $HF_TOKEN, else no token)"
        )
        sp.add_argument(
            "--endpoint", help="Hub endpoint (default: $HF_ENDPOINT, else https://huggingface.co)"
        )
        retry_args(sp)

    for name, helptext in (
        ("hub", "download repo files via huggingface_hub"),
        ("full", "whole FP8 checkpoint"),
    ):
        sp = add(name, helptext)
        remote_args(sp)
        sp.add_argument("--dest", required=True, type=Path, help="destination directory")
        sp.add_argument(
            "--include",
            nargs="*",
            default=[],
            metavar="GLOB",
            help="only files matching these globs (default: every file; `full`: *.safetensors *.json)",
        )
    sp = add("fp8-extract", "range-fetch the FP8 shared-expert tensors into one small file")
    remote_args(sp)
    sp.add_argument("--dest", required=True, type=Path, help="destination safetensors FILE")
    sp.add_argument("--pattern", default="shared_expert", help="regex on tensor names")
    sp = add("mirror", "copy from a mirror directory verified against its manifest")
    sp.add_argument("--src", required=True, type=Path, help="mirror directory holding sparkllm-manifest.json")
    sp.add_argument("--dest", required=True, type=Path, help="destination directory")
    sp.add_argument(
        "--max-rate",
        type=float,
        default=0,
        metavar="BYTES_PER_S",
        help="read at most this many bytes per second from the mirror (default 0: unlimited)",
    )
    retry_args(sp)
    sp = add("manifest", "write sparkllm-manifest.json for a directory")
    sp.add_argument("dir", type=Path, help="checkpoint directory to describe")
    sp.add_argument(
        "--no-sha256", action="store_true", help="sizes only (fast, weaker; default: with sha256)"
    )
    return p


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    """Refuse bad values (UsageError) before anything is read, written or sent."""
    if getattr(a, "retries", 0) < 0:
        raise UsageError(f"--retries {a.retries}: must be 0 (no retry) or more")
    if getattr(a, "retry_backoff_s", 0) < 0:
        raise UsageError(f"--retry-backoff-s {a.retry_backoff_s:g}: must be 0 or more seconds")
    if getattr(a, "max_rate", 0) < 0:
        raise UsageError(
            f"--max-rate {a.max_rate:g}: must be 0 (unlimited) or a positive bytes-per-second rate"
        )
    if hasattr(a, "repo") and not REPO_RE.fullmatch(a.repo):
        raise UsageError(
            f"--repo {a.repo!r}: not a Hub repo id; give owner/name, e.g. Qwen/Qwen3.5-122B-A10B-FP8"
        )
    if hasattr(a, "revision") and (not a.revision or a.revision != a.revision.strip()):
        raise UsageError(f"--revision {a.revision!r}: give a commit sha, branch or tag")
    if hasattr(a, "pattern"):
        try:
            re.compile(a.pattern)
        except re.error as exc:
            raise UsageError(f"--pattern {a.pattern!r}: not a regular expression ({exc})") from None


def dest_dir(a: argparse.Namespace) -> Path | None:
    """The directory a fetch writes (where its verified files are counted), or None (manifest)."""
    if a.cmd == "manifest":
        return None
    return a.dest.parent if a.cmd == "fp8-extract" else a.dest


def run(a: argparse.Namespace) -> dict[str, object]:
    check_args(a)
    if a.cmd == "manifest":
        return write_manifest(a.dir, not a.no_sha256)
    retry = Retry(a.retries, a.retry_backoff_s)
    if a.cmd == "mirror":
        return mirror_fetch(a.src, a.dest, a.max_rate, retry)
    # refuse a destination that is not ours before any network traffic
    if a.cmd == "fp8-extract":
        if a.dest.is_dir():
            raise UsageError(
                f"{a.dest}: --dest is a directory; fp8-extract writes one FILE: name a file inside it"
            )
        refuse_output(a.dest.parent, "--dest's directory")
    else:
        refuse_output(a.dest, "--dest")
    token = read_token(a.token_file)
    endpoint = endpoint_of(a.endpoint)
    retry.fix = f"check the network, proxy or --endpoint/HF_ENDPOINT ({endpoint}), then rerun to resume"
    if a.cmd == "fp8-extract":
        remote = Remote(endpoint, a.repo, a.revision, token, retries=a.retries, backoff_s=a.retry_backoff_s,
                        fix=retry.fix)  # fmt: skip
        return fp8_extract(remote, a.dest, a.pattern)
    include = a.include or (["*.safetensors", "*.json"] if a.cmd == "full" else [])
    client = HfHubClient(a.repo, a.revision, endpoint, token, retry)
    return hub_fetch(client, a.repo, a.revision, a.dest, include)


def kept_note(a: argparse.Namespace) -> str:
    d = dest_dir(a)
    n = len(verified_files(d)) if d is not None and d.is_dir() else 0
    return f"; {n} verified file(s) kept in {d}" if n else ""


def failure(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.filename}: {exc.strerror or exc}" if exc.filename else str(exc.strerror or exc)
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(args_list)
    rerun = shlex.join([Path(__file__).name, *args_list])
    CREATED.dirs.clear()
    try:
        with sigterm_unwinds():
            result = run(args)
    except UsageError as exc:
        CREATED.cleanup()
        return say_error(TOOL, exc, EXIT_USAGE)
    except (KeyboardInterrupt, Interrupted) as exc:
        name, rc = signal_exit(exc)
        CREATED.cleanup()
        print(f"{TOOL}: interrupted ({name}){kept_note(args)}; rerun to resume: {rerun}", file=sys.stderr,
              flush=True)
        return rc
    except (FetchError, CheckpointError, SafetensorsError, OSError) as exc:
        # a failed or interrupted fetch keeps what it verified and removes what a rerun would not reuse
        CREATED.cleanup()
        resume = f": {rerun}" if isinstance(exc, NetworkError) else ""
        return say_error(TOOL, f"{failure(exc)}{kept_note(args)}{resume}", EXIT_FAILED)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
