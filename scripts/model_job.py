#!/usr/bin/env python3
"""Fetch the model's checkpoints and merge each INT4 shard as soon as it lands: one background job.

usage: model_job.py --spec FILE --status FILE [--log FILE]

SPEC (JSON, written by the model_fetch role):
  {"fetches": [{"key": "fp8", "argv": [...], "token": true}, {"key": "int4", "argv": [...]}],
   "int4_dir": DIR, "fp8_dir": DIR, "merge_out": DIR, "token_file": FILE}
  Each argv is a complete fetch_checkpoint.py command line. merge_out is hybrid_merge.py's --out
  (the model stage's staging directory); the shards go to its <merge_out>.parts.
  "merge" (optional, default true): false for a model served as fetched (catalogue assembly none):
  then the fetch keys are any names (the checkpoints' fact keys), int4_dir, fp8_dir and merge_out are
  not used, nothing is merged or assembled and the job ends when every fetch ended.
  token_file (optional): a 0600 file holding the Hub token. The job reads it, deletes it at once and
  hands the token to the fetches marked "token" in their environment (HF_TOKEN), never in argv.

The fetches run side by side as child processes (the FP8 extract is small and lands first, the INT4
download is the long one), their progress in the log. As soon as the FP8 checkpoint is complete (its
fetch exited 0, or it was in place before) every INT4 model shard that fetch_checkpoint.py has
recorded as verified is merged into <merge_out>.parts while the rest downloads; a shard that lands
later is merged within a second of its verification. The job ends when every fetch ended and every
verified shard is merged: the model stage's hybrid_merge.py then only links the parts together.

When the last shard is merged and the INT4 checkpoint holds its MTP extra file, the job assembles
the hybrid in merge_out (hybrid_merge.py: the parts linked together, index, config, record; temp
directory + rename) and verifies it (verify_checkpoint --expect-mtp --expect-hybrid, against the INT4
and FP8 inputs' indexes and scales): the verified
hybrid is ready seconds after the last byte. The model stage then finds it current (its merge is a
no-op), runs the MTP index patch, verifies, writes the manifest and moves it into place. An assembly
that fails or does not verify is removed and left to the model stage, which reports the problem.

The status file is rewritten (atomically) as the job goes: state (running, done, failed), pid, each
fetch's exit status and result, the shards merged and when, the time the last fetch ended, the time
the last shard was merged, when the verified hybrid was ready in merge_out ("ready", null when it was
not assembled, "assembly" says why) and, on failure, the error.

A failed fetch stops the others (SIGTERM, SIGKILL after 10 s) and fails the job; so does a merge
error, and SIGTERM or SIGINT to the job itself. What was verified or merged stays: a rerun resumes
the fetches file by file and the merge shard by shard.

Exit codes: 0 done, 1 failed (the status file and the log name the problem), 2 usage error
(unreadable or invalid spec).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from fetch_checkpoint import verified_files
from hybrid_merge import merge_landed_shard
from hybrid_merge import run as merge_run
from sparkllm.checkpoint.hybrid import EXTRA_FILE, CheckpointError, load_fp8_table, verify_checkpoint
from sparkllm.checkpoint.safetensors_io import SafetensorsError
from sparkllm.cli import UsageError, WorkFailed, doc_parser, run_main
from sparkllm.fileio import write_json_atomic

POLL_S = 0.5
STOP_GRACE_S = 10.0


class JobError(WorkFailed):
    """The job failed; the message names what failed and what to do."""


class SpecError(UsageError):
    """The spec is unreadable or invalid (exit 2)."""


@dataclass
class Fetch:
    key: str
    argv: list[str]
    token: bool = False
    proc: subprocess.Popen[bytes] | None = None
    out: Path | None = None
    rc: int | None = None
    ended: float | None = None
    result: Any = None


@dataclass
class Job:
    fetches: list[Fetch]
    int4_dir: Path
    fp8_dir: Path
    merge_out: Path
    status_path: Path
    log: TextIO
    hf_token: str | None = None
    started: float = field(default_factory=time.time)
    merged: dict[str, float] = field(default_factory=dict)  # shard -> time it was merged (or found merged)
    stopping: str = ""
    ready: float | None = None  # when the verified hybrid was in merge_out
    assembly: str = ""
    merge: bool = True  # False: a model served as fetched (no INT4 + FP8 merge)

    def say(self, msg: str) -> None:
        self.log.write(f"{time.strftime('%H:%M:%S')} model_job: {msg}\n")
        self.log.flush()

    def status(self, state: str, error: str = "") -> dict[str, object]:
        ends = [f.ended for f in self.fetches if f.ended is not None]
        doc: dict[str, object] = {
            "state": state,
            "pid": os.getpid(),
            "started": self.started,
            "fetches": {f.key: {"rc": f.rc, "ended": f.ended, "result": f.result} for f in self.fetches},
            "merged": self.merged,
            "last_byte": max(ends) if ends and all(f.rc == 0 for f in self.fetches) else None,
            "last_merge": max(self.merged.values()) if self.merged else None,
            "ready": self.ready,
            "assembly": self.assembly,
            "error": error,
        }
        write_json_atomic(self.status_path, doc)
        return doc


KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def load_spec(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecError(f"{path}: cannot read the job spec ({exc}); the model_fetch role writes it") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{path}: the job spec must be a JSON object")
    merge = doc.get("merge", True)
    if not isinstance(merge, bool):
        raise SpecError(f"{path}: merge must be true or false")
    for key in ("int4_dir", "fp8_dir", "merge_out") if merge else ():
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise SpecError(f"{path}: {key} must be a non-empty path")
    if not isinstance(doc.get("token_file", ""), str):
        raise SpecError(f"{path}: token_file must be a path")
    fetches = doc.get("fetches")
    def keys_ok(k: object) -> bool:
        return k in ("int4", "fp8") if merge else isinstance(k, str) and bool(KEY_RE.fullmatch(k))

    if not isinstance(fetches, list) or not all(
        isinstance(f, dict) and keys_ok(f.get("key")) and isinstance(f.get("argv"), list)
        and f["argv"] and all(isinstance(a, str) for a in f["argv"])
        for f in fetches
    ):
        want = "'int4'|'fp8'" if merge else "NAME (letters, digits, . _ -)"
        raise SpecError(f"{path}: fetches must be a list of {{'key': {want}, 'argv': [...]}}")
    if len({f["key"] for f in fetches}) != len(fetches):
        raise SpecError(f"{path}: two fetches have the same key")
    return doc


def start_fetches(job: Job) -> None:
    # the small FP8 fetch first: every output shard needs its tensors
    for f in sorted(job.fetches, key=lambda f: f.key != "fp8"):
        f.out = job.status_path.with_name(f"{job.status_path.name}.{f.key}.out")
        env = dict(os.environ)
        env.pop("HF_TOKEN", None)
        if f.token and job.hf_token:
            env["HF_TOKEN"] = job.hf_token
        with open(f.out, "wb") as out:
            f.proc = subprocess.Popen(f.argv, stdout=out, stderr=job.log, stdin=subprocess.DEVNULL, env=env)
        job.say(f"started the {f.key.upper()} fetch (pid {f.proc.pid})")


def reap(job: Job) -> None:
    for f in job.fetches:
        if f.proc is None or f.rc is not None:
            continue
        rc = f.proc.poll()
        if rc is None:
            continue
        f.rc, f.ended = rc, time.time()
        text = f.out.read_text(encoding="utf-8", errors="replace").strip() if f.out else ""
        try:
            f.result = json.loads(text.splitlines()[-1]) if text else None
        except ValueError:
            f.result = text[-2000:]
        job.say(f"the {f.key.upper()} fetch ended with exit status {rc}")
        if rc != 0:
            raise JobError(
                f"the {f.key.upper()} fetch failed (exit status {rc}): {last_error(job, f.key)}"
            )


def last_error(job: Job, key: str) -> str:
    """The fetch tool's last error line in the log (it names the file and the problem)."""
    try:
        lines = Path(job.log.name).read_text(encoding="utf-8", errors="replace").splitlines()
    except (OSError, AttributeError, TypeError):
        lines = []
    errors = [ln for ln in lines if "error" in ln.lower() and "model_job" not in ln]
    return errors[-1].strip() if errors else f"see the log of the {key.upper()} fetch"


def stop_fetches(job: Job) -> None:
    running = [f for f in job.fetches if f.proc is not None and f.proc.poll() is None]
    for f in running:
        job.say(f"stopping the {f.key.upper()} fetch (pid {f.proc.pid})")  # type: ignore[union-attr]
        f.proc.terminate()  # type: ignore[union-attr]
    deadline = time.monotonic() + STOP_GRACE_S
    for f in running:
        try:
            f.proc.wait(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            f.proc.kill()  # type: ignore[union-attr]
            f.proc.wait()  # type: ignore[union-attr]


def fp8_ready(job: Job) -> bool:
    return all(f.rc == 0 for f in job.fetches if f.key == "fp8")


def merge_landed(job: Job, fp8: dict[str, Any] | None) -> dict[str, Any] | None:
    """Merge every verified INT4 shard not merged yet; returns the FP8 table (loaded once)."""
    if not fp8_ready(job):
        return fp8
    landed = sorted(n for n in verified_files(job.int4_dir) if n.endswith(".safetensors") and "/" not in n)
    todo = [n for n in landed if n not in job.merged]
    if not todo:
        return fp8
    if fp8 is None:
        fp8 = load_fp8_table(job.fp8_dir)
    inputs = (("--int4", job.int4_dir), ("--fp8", job.fp8_dir))
    for name in todo:
        t0 = time.monotonic()
        written = merge_landed_shard(job.int4_dir / name, fp8, job.merge_out, inputs)
        job.merged[name] = time.time()
        job.say(f"{'merged' if written else 'already merged (same inputs)'}: {name}"
                f" ({time.monotonic() - t0:.2f} s)")
        job.status("running")
    return fp8


def run(job: Job) -> dict[str, object]:
    def on_signal(signum: int, _frame: object) -> None:
        job.stopping = signal.Signals(signum).name
        raise JobError(f"stopped by {job.stopping}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    job.say(f"fetching {', '.join(f.key.upper() for f in job.fetches) or 'nothing'}; "
            + (f"merging into {job.merge_out}.parts as the INT4 shards land" if job.merge
               else "served as fetched: nothing to merge"))
    job.status("running")
    try:
        start_fetches(job)
        fp8: dict[str, Any] | None = None
        while True:
            reap(job)
            if job.merge:
                fp8 = merge_landed(job, fp8)
            if all(f.rc is not None for f in job.fetches):
                if job.merge:
                    fp8 = merge_landed(job, fp8)  # whatever landed with the last byte
                break
            time.sleep(POLL_S)
    except (JobError, CheckpointError, SafetensorsError, UsageError, OSError) as exc:
        stop_fetches(job)
        msg = str(exc)
        job.say(f"failed: {msg}")
        job.status("failed", msg)
        raise JobError(msg) from None
    if job.merge:
        assemble(job)
    else:
        job.assembly = "none: the model is served as fetched"
    doc = job.status("done")
    job.say(f"done: {len(job.merged)} shard(s) merged; {job.assembly}")
    return doc


def assemble(job: Job) -> None:
    """Link the parts into the verified hybrid in merge_out, or leave it to the model stage."""
    if not (job.int4_dir / EXTRA_FILE).is_file():
        job.assembly = f"not assembled: {EXTRA_FILE} is missing (the model stage reports it)"
        return
    try:
        result, _ = merge_run(job.int4_dir, job.fp8_dir, job.merge_out)
        report = verify_checkpoint(job.merge_out, expect_mtp=True, expect_hybrid=True,
                                   int4_source=job.int4_dir, fp8_source=job.fp8_dir)
    except (CheckpointError, SafetensorsError, UsageError, OSError) as exc:
        job.assembly = f"not assembled: {exc} (the model stage merges again and reports it)"
        return
    if not report.ok:
        shutil.rmtree(job.merge_out, ignore_errors=True)
        job.assembly = "not assembled: " + "; ".join(report.problems) + " (the model stage reports it)"
        return
    job.ready = time.time()
    reused = result.timings.get("shards_reused", 0) if result else 0
    job.assembly = f"verified hybrid ready in {job.merge_out} ({reused} merged shard(s) linked)"


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("model_job.py", __doc__)
    p.add_argument("--spec", required=True, type=Path, help="job spec (JSON), see above")
    p.add_argument("--status", required=True, type=Path, help="status file (JSON), rewritten as the job goes")
    p.add_argument("--log", type=Path, help="log file (appended; default: standard error)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run_main("model_job", lambda: start(a))


def take_token(spec: dict[str, Any]) -> str | None:
    """The Hub token from the spec's token file, which is deleted whatever happens."""
    if not spec.get("token_file"):
        return None
    token_file = Path(spec["token_file"])
    try:
        return token_file.read_text(encoding="utf-8").strip() or None
    except OSError as exc:
        raise WorkFailed(f"{token_file}: cannot read the token file ({exc.strerror}); rerun the model "
                         "stage, which writes it again") from None
    finally:
        token_file.unlink(missing_ok=True)


def start(a: argparse.Namespace) -> int:
    spec = load_spec(a.spec)
    token = take_token(spec)
    log: TextIO = open(a.log, "a", encoding="utf-8") if a.log else sys.stderr  # noqa: SIM115
    job = Job(
        fetches=[Fetch(f["key"], list(f["argv"]), bool(f.get("token"))) for f in spec["fetches"]],
        int4_dir=Path(spec.get("int4_dir") or "."),
        fp8_dir=Path(spec.get("fp8_dir") or "."),
        merge_out=Path(spec.get("merge_out") or "."),
        merge=spec.get("merge", True),
        status_path=a.status,
        log=log,
        hf_token=token,
    )
    try:
        doc = run(job)
    finally:
        if log is not sys.stderr:
            log.close()
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
