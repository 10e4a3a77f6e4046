#!/usr/bin/env python3
"""Streaming hybrid merge of an INT4 (AutoRound) and an FP8 checkpoint (standard library only).

Rules (per tensor of every INT4 model shard, i.e. every *.safetensors except the MTP extra file):
  * the tensor is 16-bit (BF16/F16), its name has no ".experts.", and the FP8 checkpoint holds a
    tensor of the same name and shape in F8_E4M3 with a "<name minus .weight>.weight_scale_inv"
    partner -> the FP8 tensor and its scale are written;
  * otherwise the INT4 tensor is written unchanged.
  The mtp.* tensors of model_extra_tensors.safetensors are carried over and registered; FP8 copies of
  mtp.* are never taken. No tensor name appears twice.

Output layout: one output shard per INT4 shard, with the same file name; a replaced tensor takes the
place of the original one and the scales are appended at the end of that shard. The MTP extra file is
kept as its own file (model_extra_tensors.safetensors). Non-weight files come from the INT4 directory;
config.json gains a "sparkllm_provenance" block; model.safetensors.index.json is rebuilt from what was
written; .sparkllm_merge.json records the input fingerprint so that a rerun on unchanged inputs with a
valid output is a no-op.

The FP8 directory may be a full FP8 checkpoint (its index decides which files are read) or a small
extract produced by `fetch_checkpoint.py fp8-extract` (all *.safetensors files are read).

The output is written to <out>.tmp-<pid> (sibling of --out, same filesystem), marked as this tool's
(.sparkllm-owner.json), fsynced and renamed into place; leftover temp directories of interrupted runs
are removed when they carry that mark. Tensors are never decoded: byte ranges are copied with
os.copy_file_range, so memory stays flat.

Shard by shard: each output shard is first written (temp file, fsync, rename) into <out>.parts, under
a name and a record of exactly what it was made from (every tensor's source file, offset and length,
and each source file's size and mtime), then hard-linked into <out>.tmp-<pid>. An interrupted merge
resumes there: a rerun writes only the shards whose part is missing or whose inputs changed. The same
parts are filled while the INT4 checkpoint is still downloading (scripts/model_job.py merges each shard
as soon as the fetch tool has verified it), so the final merge only links them. <out>.parts is removed
once the output is in place.

--out is ours or untouched: it may be new, empty, or an earlier output of this tool (which is replaced);
a non-empty directory of anyone else, an existing file, and a directory equal to, inside or holding
--int4 or --fp8 are refused before anything is written.

An --fp8 directory that contributes no FP8 weight (e.g. a second copy of the INT4 checkpoint) is
refused with exit 1, dry run included: the output would be a plain INT4 model under a hybrid's name.

Exit codes: 0 ok (or no-op), 1 the merge failed (invalid input checkpoint, an FP8 input that
contributes nothing, I/O failure),
2 usage error (bad arguments, missing input directory, an --out the tool may not write).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sparkllm.checkpoint import (
    EXTRA_FILE,
    MANIFEST_NAME,
    SOURCE_RECORD,
    CheckpointError,
    MergePlan,
    OutShard,
    TensorSource,
    dir_fingerprint,
    fingerprint_digest,
    plan_extra_shard,
    plan_index,
    plan_merge,
    plan_shard,
    read_source_record,
)
from sparkllm.cli import UsageError, doc_parser, run_main
from sparkllm.fileio import atomic_path, fsync_dir, write_json_atomic
from sparkllm.outdir import OutputRefused, check_output_dir, marker_tool, write_marker
from sparkllm.safetensors_io import (
    INDEX_NAME,
    ByteRange,
    SafetensorsError,
    TensorSpec,
    copy_ranges,
    encode_header,
    header_digest,
    read_header,
)

RECORD_NAME = ".sparkllm_merge.json"
PROVENANCE_KEY = "sparkllm_provenance"
TOOL = "hybrid_merge"
PARTS_RECORD = ".sparkllm_parts.json"
PARTS_LOCK = ".lock"
PART_FORMAT = "hybrid_merge-part/1"


@dataclass
class MergeResult:
    changed: bool
    out: Path
    summary: dict[str, object]
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)  # plan / copy / fsync phases


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("hybrid_merge.py", __doc__)
    p.add_argument("--int4", required=True, type=Path, help="INT4 AutoRound checkpoint directory")
    p.add_argument("--fp8", required=True, type=Path, help="FP8 checkpoint directory (full or fp8-extract)")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="output directory (created atomically; new, empty or an earlier output of this tool)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--json", action="store_true", help="print the result (or plan) as JSON")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def remove_stale_temps(out: Path) -> list[Path]:
    """Remove <out>.tmp-<pid> / <out>.old-<pid> siblings of ours whose process is gone.

    Only directories that carry this tool's mark (or its merge record) are ours; anything else with
    such a name is left alone.
    """
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    leftovers = [*out.parent.glob(f"{out.name}.tmp-*"), *out.parent.glob(f"{out.name}.old-*")]
    for p in leftovers:
        pid_text = p.name.rsplit("-", 1)[-1]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and _pid_alive(int(pid_text)):
            continue
        if not p.is_dir() or p.is_symlink():
            continue
        if marker_tool(p) != TOOL and not (p / RECORD_NAME).exists():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fingerprint(int4: Path, fp8: Path) -> str:
    return fingerprint_digest(
        {"int4": dir_fingerprint(int4), "fp8": dir_fingerprint(fp8), "tool": "hybrid_merge/1"}
    )


def output_is_current(out: Path, digest: str) -> bool:
    """True when ``out`` was produced from inputs with this fingerprint and still looks intact."""
    try:
        record = json.loads((out / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("input_fingerprint") != digest:
        return False
    files = record.get("outputs")
    if not isinstance(files, dict):
        return False
    for name, meta in files.items():
        p = out / name
        try:
            if p.stat().st_size != meta["size"]:
                return False
            if name.endswith(".safetensors") and header_digest(p) != meta["header_sha256"]:
                return False
        except (OSError, KeyError, TypeError, SafetensorsError):
            return False
    return True


def write_shard(shard: OutShard, path: Path) -> dict[str, object]:
    header = encode_header(TensorSpec(t.name, t.dtype, t.shape) for t in shard.tensors)
    with open(path, "wb") as dst:
        dst.write(header)
        dst.flush()
        by_src: list[tuple[Path, list[ByteRange]]] = []
        for t in shard.tensors:
            if by_src and by_src[-1][0] is t.src:
                by_src[-1][1].append(ByteRange(t.offset, t.length))
            else:
                by_src.append((t.src, [ByteRange(t.offset, t.length)]))
        fds: dict[Path, int] = {}
        try:
            for src, ranges in by_src:
                if src not in fds:  # one fd per source keeps its readahead state across runs
                    fds[src] = os.open(src, os.O_RDONLY)
                    os.posix_fadvise(fds[src], 0, 0, os.POSIX_FADV_SEQUENTIAL)
                copy_ranges(fds[src], dst.fileno(), ranges)
        finally:
            for fd in fds.values():
                os.close(fd)
    size = path.stat().st_size
    if size != len(header) + shard.data_bytes:
        raise CheckpointError(f"{path}: wrote {size} bytes, expected {len(header) + shard.data_bytes}")
    return {"size": size, "header_sha256": hashlib.sha256(header).hexdigest()}


def parts_dir(out: Path) -> Path:
    """Where the shards of ``out`` are merged one by one before the output is assembled."""
    return out.with_name(f"{out.name}.parts")


def part_identity(shard: OutShard) -> str:
    """What a part was made from: the layout (every tensor's source, offset, length) and each source
    file's size and mtime. A refetched or changed input file changes it; nothing else does."""
    sources: dict[str, object] = {}
    real: dict[Path, str] = {}
    for t in shard.tensors:
        if t.src not in real:
            real[t.src] = os.path.realpath(t.src)
            st = os.stat(t.src)
            sources[real[t.src]] = [st.st_size, st.st_mtime_ns]
    layout = [[t.name, t.dtype, list(t.shape), real[t.src], t.offset, t.length] for t in shard.tensors]
    doc = {"format": PART_FORMAT, "shard": shard.name, "tensors": layout, "sources": sources}
    return fingerprint_digest(doc)


class PartStore:
    """<out>.parts: merged shards by name with a record of their inputs; one writer at a time (flock).

    Use as a context manager: entering takes the lock (waiting for another merge filling the same
    parts), leaving releases it."""

    def __init__(self, out: Path, inputs: tuple[tuple[str, Path], ...] = ()) -> None:
        self.dir = parts_dir(out)
        self.inputs = inputs
        self._fd: int | None = None
        self.record: dict[str, dict[str, object]] = {}

    def __enter__(self) -> PartStore:
        try:
            check_output_dir(self.dir, TOOL, inputs=self.inputs, flag="--out's parts directory")
        except OutputRefused as exc:
            raise UsageError(str(exc)) from None
        self.dir.mkdir(parents=True, exist_ok=True)
        write_marker(self.dir, TOOL)
        self._fd = os.open(self.dir / PARTS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            doc = json.loads((self.dir / PARTS_RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = {}
        self.record = doc if isinstance(doc, dict) else {}
        for leftover in self.dir.glob(".*.part-*"):  # a write cut by a crash (we hold the lock)
            leftover.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def current(self, shard: OutShard, identity: str | None = None) -> bool:
        entry = self.record.get(shard.name)
        path = self.dir / shard.name
        if not isinstance(entry, dict) or entry.get("input") != (identity or part_identity(shard)):
            return False
        try:
            same_size = path.stat().st_size == entry.get("size")
            return same_size and header_digest(path) == entry.get("header_sha256")
        except (OSError, SafetensorsError):
            return False

    def ensure(self, shard: OutShard) -> bool:
        """Make sure the part of ``shard`` is there for its current inputs; True when it was written now."""
        identity = part_identity(shard)
        if self.current(shard, identity):
            return False
        with atomic_path(self.dir / shard.name, "part") as tmp:
            meta = write_shard(shard, tmp)
        self.record[shard.name] = {"input": identity, **meta, "merged_at": time.time()}
        write_json_atomic(self.dir / PARTS_RECORD, self.record)
        return True

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def merge_landed_shard(int4_file: Path, fp8: Mapping[str, TensorSource], out: Path,
                       inputs: tuple[tuple[str, Path], ...] = ()) -> bool:
    """Merge one INT4 model shard into <out>.parts as soon as it is in place (the rest of the INT4
    checkpoint may still be on its way); True when the part was written now, False when it was
    already there for the same inputs."""
    try:
        header = read_header(int4_file)
    except SafetensorsError as exc:
        raise CheckpointError(str(exc)) from None
    shard = plan_extra_shard(header) if int4_file.name == EXTRA_FILE else plan_shard(header, fp8)[0]
    with PartStore(out, inputs) as parts:
        return parts.ensure(shard)


def place_part(src: Path, dst: Path) -> None:
    """Hard-link a part into the output being assembled (same filesystem); copy where links fail."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def copy_side_files(int4: Path, tmp: Path, plan: MergePlan) -> None:
    shard_names = {s.name for s in plan.shards}
    for p in sorted(int4.iterdir()):
        if p.name in shard_names or p.name == INDEX_NAME or p.suffix == ".safetensors":
            continue
        # our own bookkeeping (merge record, source record, mirror manifest) and hidden files stay behind
        if p.name in (RECORD_NAME, SOURCE_RECORD, MANIFEST_NAME) or p.name.startswith("."):
            continue
        if p.is_dir():
            shutil.copytree(p, tmp / p.name)
        elif p.is_file():
            shutil.copy2(p, tmp / p.name)


def provenance(int4: Path, fp8: Path, plan: MergePlan) -> dict[str, object]:
    def source(d: Path) -> dict[str, object]:
        rec = read_source_record(d)
        return {
            "path": str(d.resolve()),
            "repo": rec.get("repo"),
            "revision": rec.get("commit") or rec.get("revision"),
        }

    return {
        "tool": "sparkllm hybrid_merge",
        "int4": source(int4),
        "fp8": source(fp8),
        "counts": plan.summary(),
        "note": "informational only; quantization_config is the INT4 checkpoint's",
    }


def patch_config(tmp: Path, prov: dict[str, object]) -> None:
    cfg = tmp / "config.json"
    if not cfg.is_file():
        return
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{cfg}: invalid JSON ({exc})") from None
    doc[PROVENANCE_KEY] = prov
    write_json_atomic(cfg, doc)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and the directories themselves.

    Done once at the end rather than per shard so that kernel write-back of earlier shards
    overlaps with copying later ones.
    """
    for p in sorted(root.rglob("*")):
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(root)


def execute(
    plan: MergePlan,
    int4: Path,
    fp8: Path,
    out: Path,
    digest: str,
    timings: dict[str, float],
    parts: PartStore,
) -> None:
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        write_marker(tmp, TOOL)
        outputs: dict[str, object] = {}
        t0 = time.monotonic()
        written = 0
        for shard in plan.shards:
            written += parts.ensure(shard)
            place_part(parts.dir / shard.name, tmp / shard.name)
            meta = parts.record[shard.name]
            outputs[shard.name] = {"size": meta["size"], "header_sha256": meta["header_sha256"]}
        timings["copy"] = time.monotonic() - t0
        timings["shards_written"] = written
        timings["shards_reused"] = len(plan.shards) - written
        copy_side_files(int4, tmp, plan)
        patch_config(tmp, provenance(int4, fp8, plan))
        write_json_atomic(tmp / INDEX_NAME, plan_index(plan))
        write_json_atomic(
            tmp / RECORD_NAME,
            {
                "input_fingerprint": digest,
                "outputs": outputs,
                "summary": plan.summary(),
                "created": time.time(),
            },
        )
        t0 = time.monotonic()
        fsync_tree(tmp)
        timings["fsync"] = time.monotonic() - t0
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def format_plan(plan: MergePlan) -> str:
    lines = [f"taken from FP8 ({len(plan.taken)} weights + {len(plan.taken)} scales):"]
    lines += [f"  {n}" for n in plan.taken]
    lines.append(f"kept from INT4: {plan.kept} tensors")
    lines.append(f"MTP registered from {EXTRA_FILE}: {len(plan.mtp)} tensors")
    lines.append(f"FP8 candidates skipped ({len(plan.skipped)}):")
    lines += [f"  {s.name}: {s.reason}" for s in plan.skipped]
    lines.append("output shards: " + ", ".join(f"{s.name} ({len(s.tensors)} tensors)" for s in plan.shards))
    return "\n".join(lines)


def plan_json(plan: MergePlan) -> dict[str, object]:
    return {
        "summary": plan.summary(),
        "taken_from_fp8": plan.taken,
        "mtp_registered": plan.mtp,
        "skipped": [{"name": s.name, "reason": s.reason} for s in plan.skipped],
        "shards": {s.name: [t.name for t in s.tensors] for s in plan.shards},
    }


def refuse_empty_fp8(plan: MergePlan, fp8: Path) -> None:
    """An FP8 input that gives the merge nothing would yield a plain INT4 copy under a hybrid's name:
    refuse it (exit 1) with the likely mix-up, before anything is written (dry run too)."""
    if plan.taken:
        return
    if not any(s.reason != "mtp (taken from the INT4 extra file)" for s in plan.skipped):
        raise CheckpointError(
            f"--fp8 {fp8} contributes no FP8 weight (it holds no F8_E4M3 tensor with a scale matching "
            "an INT4 name): is it a second copy of the INT4 checkpoint? pass Qwen's FP8 release "
            "(Qwen/Qwen3.5-122B-A10B-FP8) or its fp8-extract"
        )
    generic = ("no INT4 tensor of that name", "expert", "mtp (taken from the INT4 extra file)")
    first = next((s for s in plan.skipped if s.reason not in generic), plan.skipped[0])
    raise CheckpointError(
        f"--fp8 {fp8} contributes no FP8 weight: none of its {len(plan.skipped)} FP8 candidates "
        f"matches an INT4 tensor (e.g. {first.name}: {first.reason}): is it the "
        "FP8 release of another model? pass Qwen's FP8 release of the same model"
    )


def run(
    int4: Path, fp8: Path, out: Path, dry_run: bool = False
) -> tuple[MergeResult | None, MergePlan | None]:
    for d, flag in ((int4, "--int4"), (fp8, "--fp8")):
        if not d.is_dir():
            what = "is not a directory" if d.exists() else "directory does not exist"
            raise UsageError(f"{d}: {flag} {what}; pass the checkpoint directory")
    try:
        check_output_dir(out, TOOL, inputs=(("--int4", int4), ("--fp8", fp8)), legacy=(RECORD_NAME,))
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    start = time.monotonic()
    if not dry_run:
        remove_stale_temps(out)
    digest = fingerprint(int4, fp8)
    if not dry_run and output_is_current(out, digest):
        if parts_dir(out).is_dir():
            with PartStore(out, inputs=(("--int4", int4), ("--fp8", fp8))) as parts:
                parts.remove()
        rec = json.loads((out / RECORD_NAME).read_text(encoding="utf-8"))
        return MergeResult(False, out, rec.get("summary", {}), time.monotonic() - start), None
    plan = plan_merge(int4, fp8)
    refuse_empty_fp8(plan, fp8)
    if dry_run:
        return None, plan
    timings = {"plan": time.monotonic() - start}
    with PartStore(out, inputs=(("--int4", int4), ("--fp8", fp8))) as parts:
        execute(plan, int4, fp8, out, digest, timings, parts)
        parts.remove()  # the output holds every shard now (hard links)
    return MergeResult(True, out, plan.summary(), time.monotonic() - start, timings), plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(TOOL, lambda: print_outcome(args), failed=(CheckpointError, SafetensorsError, OSError))


def print_outcome(args: argparse.Namespace) -> int:
    result, plan = run(args.int4, args.fp8, args.out, args.dry_run)
    if result is None:
        assert plan is not None
        print(json.dumps(plan_json(plan), indent=2) if args.json else format_plan(plan))
        return 0
    if args.json:
        print(
            json.dumps(
                {
                    "changed": result.changed,
                    "out": str(result.out),
                    "seconds": round(result.seconds, 3),
                    "phases": {k: round(v, 3) for k, v in result.timings.items()},
                    "summary": result.summary,
                }
            )
        )
    elif result.changed:
        print(f"merged into {result.out} in {result.seconds:.1f}s: {result.summary}")
    else:
        print(f"{result.out} is up to date (inputs unchanged); nothing to do")
    return 0


if __name__ == "__main__":
    sys.exit(main())
