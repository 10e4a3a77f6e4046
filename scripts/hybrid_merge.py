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

Inputs first: the INT4 index (model.safetensors.index.json) must name only shards that are present, and
every tensor must be in the shard it names (a deleted or never-downloaded shard is refused, exit 1);
FP8 tensors must be F8_E4M3 (an F8_E5M2 weight is refused by name, exit 1). Then the space: the bytes
the merge will write (the shards not merged yet in <out>.parts, the side files, each rounded up to the
filesystem's block) against the free space on --out's filesystem; too little is refused (exit 2) with
both sizes, before anything is written. A disk that fills up anyway is named with its path and sizes.

One merge per --out at a time: a merge holds an flock on .<out>.lock beside --out (holding its pid)
from start to end; a second merge is refused (exit 2) naming the first one's pid.

A complete output is a directory with this tool's owner mark (.sparkllm-owner.json), the index and the
merge record whose every listed file has its recorded size and header digest (the record is written
last). A complete output is never deleted before a newer complete one is in place: when --out is
missing (a kill between the final `--out -> <out>.old-PID` and `<out>.tmp-PID -> --out`), the newest
complete <out>.tmp-* / <out>.old-* is renamed back to --out first, whatever the rest of the run does;
other leftovers of dead merges are removed only once the inputs and the space were checked (incomplete
ones) or a complete output is in place (complete ones).

--out is ours or untouched: it may be new, empty, or an earlier output of this tool (which is replaced);
a non-empty directory of anyone else, an existing file, and a directory equal to, inside or holding
--int4 or --fp8 are refused before anything is written.

An --fp8 directory that contributes no FP8 weight (e.g. a second copy of the INT4 checkpoint) is
refused with exit 1, dry run included: the output would be a plain INT4 model under a hybrid's name.

Exit codes: 0 ok (or no-op), 1 the merge failed (invalid input checkpoint: a missing shard, a tensor
not where the index says, an FP8 weight not F8_E4M3; an FP8 input that contributes nothing; I/O failure,
a disk that fills up), 2 usage error (bad arguments, missing input directory, an --out the tool may not
write, too little free space for it, another merge writing it).
"""

from __future__ import annotations

import argparse
import errno
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

from sparkllm.checkpoint.hybrid import (
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
from sparkllm.checkpoint.safetensors_io import (
    INDEX_NAME,
    ByteRange,
    SafetensorsError,
    TensorSpec,
    copy_ranges,
    encode_header,
    header_digest,
    read_header,
)
from sparkllm.cli import UsageError, doc_parser, run_main
from sparkllm.fileio import atomic_path, existing_ancestor, free_bytes, fsync_dir, write_json_atomic
from sparkllm.outdir import OutputRefused, check_output_dir, marker_tool, write_marker

RECORD_NAME = ".sparkllm_merge.json"
PROVENANCE_KEY = "sparkllm_provenance"
TOOL = "hybrid_merge"
PARTS_RECORD = ".sparkllm_parts.json"
PARTS_LOCK = ".lock"
PART_FORMAT = "hybrid_merge-part/1"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceError(CheckpointError):
    """The filesystem filled up during the merge; the message names the path, the sizes and the fix."""


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


def leftovers(out: Path) -> list[Path]:
    """<out>.tmp-<pid> / <out>.old-<pid> directories of ours whose process is gone.

    Only directories that carry this tool's mark (or its merge record) are ours; anything else with
    such a name is left alone.
    """
    if not out.parent.is_dir():
        return []
    found = []
    for p in [*out.parent.glob(f"{out.name}.tmp-*"), *out.parent.glob(f"{out.name}.old-*")]:
        pid_text = p.name.rsplit("-", 1)[-1]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and _pid_alive(int(pid_text)):
            continue
        if not p.is_dir() or p.is_symlink():
            continue
        if marker_tool(p) != TOOL and not (p / RECORD_NAME).exists():
            continue
        found.append(p)
    return found


def remove_stale_temps(out: Path, keep_complete: bool = False) -> list[Path]:
    """Remove the leftovers of dead merges; with ``keep_complete`` only the incomplete ones (call it
    without only once a complete output is in place)."""
    removed: list[Path] = []
    for p in leftovers(out):
        if keep_complete and complete_output(p):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def complete_output(d: Path) -> bool:
    """A finished output of this tool: owner mark, index, and the merge record (written last) whose
    every listed file is there with its recorded size and header digest."""
    return marker_tool(d) == TOOL and (d / INDEX_NAME).is_file() and output_is_current(d, None)


def recover_output(out: Path) -> Path | None:
    """When --out is missing, rename the newest complete leftover back to it (a kill between the two
    final renames leaves the new output as <out>.tmp-PID and the earlier one as <out>.old-PID)."""
    if out.exists() or out.is_symlink():
        return None

    def created(p: Path) -> tuple[float, bool]:
        try:
            when = float(json.loads((p / RECORD_NAME).read_text(encoding="utf-8")).get("created", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            when = 0.0
        return when, ".tmp-" in p.name  # the temp was about to replace the old one

    found = sorted((p for p in leftovers(out) if complete_output(p)), key=created)
    if not found:
        return None
    os.replace(found[-1], out)
    fsync_dir(out.parent)
    return found[-1]


def lock_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.lock")


class OutLock:
    """One merge per --out: an exclusive flock on .<out>.lock (beside --out, holding the pid), refused
    at once when another merge holds it; the file is removed when the merge ends."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = lock_path(out)
        self.fd: int | None = None

    def __enter__(self) -> OutLock:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise UsageError(f"{self.out}: another merge is writing {self.out} (pid {pid}); wait for it "
                                 f"to end or stop it, then rerun (nothing was touched)") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False  # the holder removed the file as we took it: take the new one
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
            else:
                os.close(fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


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


def output_is_current(out: Path, digest: str | None) -> bool:
    """True when ``out`` was produced from inputs with this fingerprint (any, when None) and still
    looks intact."""
    try:
        record = json.loads((out / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or digest is not None and record.get("input_fingerprint") != digest:
        return False
    files = record.get("outputs")
    if not isinstance(files, dict) or not files:
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


def shard_header(shard: OutShard) -> bytes:
    return encode_header(TensorSpec(t.name, t.dtype, t.shape) for t in shard.tensors)


def no_space(exc: OSError, where: Path, need: int, out: Path) -> NoSpaceError:
    """The one message of a disk that filled up during the merge: the path, the sizes, the fix."""
    return NoSpaceError(
        f"{where}: {exc.strerror or os.strerror(exc.errno or errno.ENOSPC)} [Errno {exc.errno}] while "
        f"writing the merge; writing it needs {need} bytes and {free_bytes(where)} bytes free now on that "
        f"filesystem: free space there (or choose --out on a filesystem with room) and rerun; {out} was "
        f"left as it was, shards already merged in {parts_dir(out)} are reused")


def write_shard(shard: OutShard, path: Path) -> dict[str, object]:
    header = shard_header(shard)
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

    def peek(self) -> PartStore:
        """Read the record without taking the lock or creating anything (to estimate what is left)."""
        try:
            doc = json.loads((self.dir / PARTS_RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = {}
        self.record = doc if isinstance(doc, dict) else {}
        return self

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
        try:
            with atomic_path(self.dir / shard.name, "part") as tmp:
                meta = write_shard(shard, tmp)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                need = len(shard_header(shard)) + shard.data_bytes
                raise no_space(exc, self.dir / shard.name, need, self.dir.with_name(
                    self.dir.name.removesuffix(".parts"))) from None
            raise
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


def side_files(int4: Path, plan: MergePlan) -> list[Path]:
    """The INT4 directory's files and folders the output takes as they are (configs, tokenizer)."""
    shard_names = {s.name for s in plan.shards}
    return [
        p for p in sorted(int4.iterdir())
        if not (p.name in shard_names or p.name == INDEX_NAME or p.suffix == ".safetensors")
        # our own bookkeeping (merge record, source record, mirror manifest) and hidden files stay behind
        and not (p.name in (RECORD_NAME, SOURCE_RECORD, MANIFEST_NAME) or p.name.startswith("."))
    ]


def bytes_needed(plan: MergePlan, int4: Path, out: Path) -> int:
    """What the merge will write beside --out: the parts not merged yet for these inputs, the side files,
    the index, record and marker, each file rounded up to the filesystem's block (statvfs f_frsize).
    The parts are hard-linked into the output, so a part already merged costs nothing more."""
    block = max(1, os.statvfs(existing_ancestor(out.parent)).f_frsize)

    def on_disk(n: int) -> int:
        return -(-n // block) * block + block  # whole blocks, and one for the inode's directory entry

    parts = PartStore(out).peek()
    need = sum(on_disk(len(shard_header(s)) + s.data_bytes) for s in plan.shards if not parts.current(s))
    for p in side_files(int4, plan):
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        need += sum(on_disk(f.stat().st_size) for f in files)
    index = len(json.dumps(plan_index(plan), indent=2))
    return need + 2 * on_disk(index) + 3 * block  # index, record (smaller than it), marker, config rewrite


def check_space(plan: MergePlan, int4: Path, out: Path) -> None:
    """Refuse (exit 2) before anything is written when --out's filesystem lacks the room."""
    need, free = bytes_needed(plan, int4, out), free_bytes(out.parent)
    if need > free:
        gib = 1 << 30
        raise UsageError(
            f"{out}: the merge needs {need} bytes ({need / gib:.1f} GiB) on the filesystem of "
            f"{existing_ancestor(out.parent)}, which has {free} bytes free ({free / gib:.1f} GiB): free "
            f"space there or choose --out on a filesystem with room, then rerun (nothing was written)")


def copy_side_files(int4: Path, tmp: Path, plan: MergePlan) -> None:
    for p in side_files(int4, plan):
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
    try:
        tmp.mkdir()
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
        try:
            os.replace(tmp, out)
        except BaseException:
            if old.exists() and not out.exists():
                os.replace(old, out)  # the earlier output stays until a new one is in place
            raise
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in NO_SPACE:
            side = sum(f.stat().st_size for p in side_files(int4, plan)
                       for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
            raise no_space(exc, tmp, side, out) from None
        raise
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
    inputs = (("--int4", int4), ("--fp8", fp8))
    try:
        check_output_dir(out, TOOL, inputs=inputs, legacy=(RECORD_NAME,))
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    start = time.monotonic()
    if dry_run:
        plan = plan_merge(int4, fp8)
        refuse_empty_fp8(plan, fp8)
        return None, plan
    with OutLock(out):
        recover_output(out)  # a complete output left by a kill between the two renames comes back first
        plan = plan_merge(int4, fp8)  # inputs checked (index, shards, dtypes) before any output is touched
        refuse_empty_fp8(plan, fp8)
        digest = fingerprint(int4, fp8)
        if output_is_current(out, digest):
            if parts_dir(out).is_dir():
                with PartStore(out, inputs=inputs) as parts:
                    parts.remove()
            remove_stale_temps(out)
            rec = json.loads((out / RECORD_NAME).read_text(encoding="utf-8"))
            return MergeResult(False, out, rec.get("summary", {}), time.monotonic() - start), None
        remove_stale_temps(out, keep_complete=True)
        check_space(plan, int4, out)
        timings = {"plan": time.monotonic() - start}
        with PartStore(out, inputs=inputs) as parts:
            execute(plan, int4, fp8, out, digest, timings, parts)
            parts.remove()  # the output holds every shard now (hard links)
        remove_stale_temps(out)  # a complete output is in place: earlier ones were replaced
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
