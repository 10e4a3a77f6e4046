"""Checkpoint logic shared by the scripts and the Ansible module (standard library only).

- merge planning for the hybrid INT4 + FP8 checkpoint (``plan_merge``),
- MTP index patch (``plan_mtp_patch`` / ``apply_mtp_patch``),
- verification (``verify_checkpoint``),
- manifests and input fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..fileio import place_atomic, sha256_file, write_json_atomic
from ..outdir import MARKER as OWNER_MARKER
from ..outdir import OutputRefused, made_by_toolkit
from .inputs import FP8_DTYPE, index_problems, other_fp8_types, output_problems
from .safetensors_io import (
    INDEX_NAME,
    SIXTEEN_BIT,
    Header,
    SafetensorsError,
    TensorInfo,
    build_index,
    header_digest,
    read_header,
    read_index,
)

EXTRA_FILE = "model_extra_tensors.safetensors"
MTP_PREFIX = "mtp."
SCALE_SUFFIX = ".weight_scale_inv"
SOURCE_RECORD = ".sparkllm_source.json"
MERGE_RECORD = ".sparkllm_merge.json"
MANIFEST_NAME = "sparkllm-manifest.json"


class CheckpointError(Exception):
    """Invalid input checkpoint (message names the file and the problem)."""


def scale_name(weight_name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``."""
    base = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return base + SCALE_SUFFIX


def is_expert(name: str) -> bool:
    return ".experts." in name


def is_mtp(name: str) -> bool:
    return name.startswith(MTP_PREFIX)


# ------------------------------------------------------------------ loading


@dataclass(slots=True)
class TensorSource:
    """Where a tensor lives: its file header and entry."""

    header: Header
    info: TensorInfo

    @property
    def file(self) -> str:
        return self.header.path.name


def safetensors_files(directory: Path, use_index: bool = True) -> list[Path]:
    """Files of a checkpoint: those named by its index when present, else every *.safetensors."""
    idx = directory / INDEX_NAME
    if use_index and idx.is_file():
        index = read_index(idx)
        files = [directory / f for f in index.files]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{idx}: lists {f.name}, which does not exist")
        return files
    return sorted(p for p in directory.glob("*.safetensors") if p.is_file())


def load_headers(files: Iterable[Path]) -> dict[str, Header]:
    out: dict[str, Header] = {}
    for f in files:
        try:
            out[f.name] = read_header(f)
        except SafetensorsError as exc:
            raise CheckpointError(str(exc)) from None
    return out


def tensor_table(headers: Mapping[str, Header]) -> dict[str, TensorSource]:
    table: dict[str, TensorSource] = {}
    for fname in sorted(headers):
        h = headers[fname]
        for name, info in h.tensors.items():
            if name in table:
                raise CheckpointError(f"{h.path}: tensor {name!r} is also in {table[name].header.path}")
            table[name] = TensorSource(h, info)
    return table


# ------------------------------------------------------------------ merge planning


@dataclass(frozen=True, slots=True)
class OutTensor:
    """A tensor of an output shard: copy ``length`` bytes of ``src`` at ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    src: Path
    offset: int
    length: int
    origin: str  # "int4" | "fp8" | "fp8-scale" | "mtp"


@dataclass
class OutShard:
    name: str
    tensors: list[OutTensor] = field(default_factory=list)

    @property
    def data_bytes(self) -> int:
        return sum(t.length for t in self.tensors)


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


@dataclass
class MergePlan:
    shards: list[OutShard]
    taken: list[str]  # weight names taken from FP8 (each with its scale)
    kept: int  # INT4 tensors kept unchanged
    mtp: list[str]
    skipped: list[Skipped]

    @property
    def tensor_count(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    @property
    def total_size(self) -> int:
        return sum(s.data_bytes for s in self.shards)

    def summary(self) -> dict[str, object]:
        return {
            "taken_from_fp8": len(self.taken),
            "scales_added": len(self.taken),
            "kept_from_int4": self.kept,
            "mtp_registered": len(self.mtp),
            "fp8_candidates_skipped": len(self.skipped),
            "tensors": self.tensor_count,
            "total_size": self.total_size,
        }


def _out(src: TensorSource, origin: str) -> OutTensor:
    off, length = src.header.absolute(src.info.name)
    return OutTensor(src.info.name, src.info.dtype, src.info.shape, src.header.path, off, length, origin)


def fp8_replacement(int4: TensorInfo, fp8: Mapping[str, TensorSource]) -> tuple[TensorSource | None, str]:
    """(scale source, "") when the FP8 tensor of the same name replaces ``int4``, else (None, reason)."""
    cand = fp8.get(int4.name)
    if cand is None or cand.info.dtype != FP8_DTYPE:
        return None, "no FP8 tensor"
    if is_expert(int4.name):
        return None, "expert"
    if int4.dtype not in SIXTEEN_BIT:
        return None, f"INT4 tensor is {int4.dtype}, not 16-bit"
    if cand.info.shape != int4.shape:
        return None, f"shape mismatch (INT4 {list(int4.shape)}, FP8 {list(cand.info.shape)})"
    scale = fp8.get(scale_name(int4.name))
    if scale is None:
        return None, f"no scale ({scale_name(int4.name)} missing)"
    return scale, ""


def _skip_reason_without_int4(name: str, int4_names: set[str]) -> str | None:
    if is_mtp(name):
        return "mtp (taken from the INT4 extra file)"
    if name in int4_names:
        return None
    if is_expert(name):
        return "expert"
    return "no INT4 tensor of that name"


def load_fp8_table(fp8_dir: Path) -> dict[str, TensorSource]:
    """Every tensor of the FP8 checkpoint (full or extract), by name; raises ``CheckpointError``."""
    fp8_headers = load_headers(safetensors_files(fp8_dir))
    if not fp8_headers:
        raise CheckpointError(f"{fp8_dir}: no *.safetensors files found")
    problems = index_problems(fp8_dir, fp8_headers, every_tensor_listed=False) + other_fp8_types(fp8_headers)
    if problems:
        raise CheckpointError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return tensor_table(fp8_headers)


def plan_shard(header: Header, fp8: Mapping[str, TensorSource]) -> tuple[OutShard, list[str], list[Skipped]]:
    """The output shard of one INT4 model shard: (shard, weights taken from FP8, skipped candidates).

    Needs only that shard's header and the FP8 tensors, so a shard can be merged as soon as it has
    landed, before the rest of the INT4 checkpoint."""
    shard = OutShard(header.path.name)
    scales: list[OutTensor] = []
    taken: list[str] = []
    skipped: list[Skipped] = []
    for info in header.tensors.values():
        scale, reason = fp8_replacement(info, fp8)
        if scale is not None:
            shard.tensors.append(_out(fp8[info.name], "fp8"))
            scales.append(_out(scale, "fp8-scale"))
            taken.append(info.name)
        else:
            if reason not in ("no FP8 tensor",):
                skipped.append(Skipped(info.name, reason))
            shard.tensors.append(_out(TensorSource(header, info), "int4"))
    shard.tensors.extend(scales)
    return shard, taken, skipped


def plan_extra_shard(header: Header) -> OutShard:
    """The MTP extra file is carried over as it is (FP8 copies of mtp.* are never taken)."""
    tensors = [_out(TensorSource(header, info), "mtp") for info in header.tensors.values()]
    return OutShard(header.path.name, tensors)


def plan_merge(int4_dir: Path, fp8_dir: Path, extra_file: str = EXTRA_FILE) -> MergePlan:
    """Plan the hybrid merge; validates every input header (raises ``CheckpointError``)."""
    int4_files = [p for p in safetensors_files(int4_dir, use_index=False) if p.name != extra_file]
    if not int4_files:
        raise CheckpointError(f"{int4_dir}: no *.safetensors model shards found")
    int4_headers = load_headers(int4_files)
    int4 = tensor_table(int4_headers)
    extra_path = int4_dir / extra_file
    mtp_header = load_headers([extra_path])[extra_file] if extra_path.is_file() else None
    present = {**int4_headers, **({extra_file: mtp_header} if mtp_header else {})}
    problems = index_problems(int4_dir, present, unlisted_ok=(extra_file,))  # before anything is written
    if problems:
        raise CheckpointError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    fp8 = load_fp8_table(fp8_dir)

    shards: list[OutShard] = []
    taken: list[str] = []
    skipped: list[Skipped] = []
    kept = 0
    for fname in sorted(int4_headers):
        shard, shard_taken, shard_skipped = plan_shard(int4_headers[fname], fp8)
        shards.append(shard)
        taken += shard_taken
        skipped += shard_skipped
        kept += len(shard.tensors) - 2 * len(shard_taken)

    int4_names = set(int4)
    mtp_names: list[str] = []
    if mtp_header is not None:
        for name in mtp_header.tensors:
            if name in int4:
                raise CheckpointError(f"{extra_path}: tensor {name!r} is also in {int4[name].header.path}")
            mtp_names.append(name)
        shards.append(plan_extra_shard(mtp_header))

    taken_set = set(taken)
    scale_names = {scale_name(n) for n in taken}
    for name, src in fp8.items():
        if src.info.dtype != FP8_DTYPE or name in taken_set or name in scale_names:
            continue
        reason = _skip_reason_without_int4(name, int4_names)
        if reason is not None:
            skipped.append(Skipped(name, reason))
    skipped.sort(key=lambda s: s.name)
    out_names: set[str] = set()
    for s in shards:
        for t in s.tensors:
            if t.name in out_names:
                raise CheckpointError(f"{int4_dir}: tensor {t.name!r} would appear twice in the output")
            out_names.add(t.name)
    return MergePlan(shards=shards, taken=taken, kept=kept, mtp=mtp_names, skipped=skipped)


# ------------------------------------------------------------------ fingerprints and manifests


def _files_fingerprint(directory: Path, keep: Callable[[Path], bool]) -> dict[str, object]:
    """Names, sizes, mtimes and safetensors header digests of the files of ``directory`` that ``keep``."""
    files: dict[str, object] = {}
    for p in sorted(directory.iterdir()):
        if not p.is_file() or not keep(p):
            continue
        st = p.stat()
        entry: dict[str, object] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if p.suffix == ".safetensors":
            try:
                entry["header_sha256"] = header_digest(p)
            except SafetensorsError:
                entry["header_sha256"] = "invalid"
        files[p.name] = entry
    return {"path": str(directory.resolve()), "files": files}


def dir_fingerprint(directory: Path) -> dict[str, object]:
    """Cheap identity of a directory's files: names, sizes, mtimes, safetensors header digests."""
    # the manifest is written after a fetch (and after a merge that ran as the shards landed)
    return _files_fingerprint(
        directory,
        lambda p: not p.name.startswith(".sparkllm_merge") and p.name not in (OWNER_MARKER, MANIFEST_NAME),
    )


def tensor_files_fingerprint(directory: Path) -> dict[str, object]:
    """Identity of what a merge reads from a checkpoint directory: its *.safetensors files and its
    index (size, mtime, header digest), not the bookkeeping files written next to them later (the
    manifest, the fetch records), so it stays the same from the moment the files are in place."""
    return _files_fingerprint(directory, lambda p: p.suffix == ".safetensors" or p.name == INDEX_NAME)


def fingerprint_digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    size: int
    sha256: str | None = None


def build_manifest(directory: Path, with_sha256: bool = True) -> list[ManifestEntry]:
    """Every regular file under ``directory`` (relative POSIX names).

    Skips the manifest itself and hidden files and directories (state/provenance records, caches).
    """
    entries: list[ManifestEntry] = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if (
            not p.is_file()
            or p.name == MANIFEST_NAME
            or any(part.startswith(".") for part in Path(rel).parts)
        ):
            continue
        entries.append(ManifestEntry(rel, p.stat().st_size, sha256_file(p) if with_sha256 else None))
    return entries


def manifest_doc(entries: Iterable[ManifestEntry]) -> dict[str, object]:
    return {"version": 1, "files": [asdict(e) for e in entries]}


def read_manifest(path: Path) -> list[ManifestEntry]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        files = doc["files"]
        entries = [ManifestEntry(str(f["name"]), int(f["size"]), f.get("sha256")) for f in files]
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read manifest ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: invalid manifest ({exc})") from None
    for e in entries:
        if e.name.startswith("/") or ".." in Path(e.name).parts:
            raise CheckpointError(f"{path}: unsafe file name in manifest: {e.name!r}")
    return entries


# ------------------------------------------------------------------ MTP index patch


@dataclass
class MtpPatchResult:
    changed: bool
    added: int
    copied: bool
    linked: bool
    total_size_before: int | None
    total_size_after: int
    entries_before: int
    entries_after: int
    mtp_tensors: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def diff(self) -> dict[str, str]:
        def text(entries: int, total: int | None, present: bool) -> str:
            return f"weight_map entries: {entries}\ntotal_size: {total}\n{EXTRA_FILE} present: {present}\n"

        return {
            "before": text(self.entries_before, self.total_size_before, not self.copied),
            "after": text(self.entries_after, self.total_size_after, True),
        }


def _index_doc(target: Path) -> dict[str, object]:
    idx = target / INDEX_NAME
    if not idx.is_file():
        raise CheckpointError(f"{idx}: index missing; the target must be a sharded checkpoint with an index")
    read_index(idx)  # validate
    return json.loads(idx.read_text(encoding="utf-8"))


def _total_size(target: Path, weight_map: Mapping[str, str], extra: tuple[str, Header]) -> int:
    total = 0
    for fname in sorted(set(weight_map.values())):
        header = extra[1] if fname == extra[0] else None
        if header is None:
            path = target / fname
            if not path.is_file():
                raise CheckpointError(f"{target / INDEX_NAME}: lists {fname}, which does not exist")
            try:
                header = read_header(path)
            except SafetensorsError as exc:
                raise CheckpointError(str(exc)) from None
        total += sum(t.nbytes for t in header.tensors.values())
    return total


def _check_mtp_target(source: Path, target: Path) -> None:
    """Refuse a target the patch may not write (OutputRefused: usage error)."""
    if not target.is_dir():
        what = "is not a directory" if target.exists() else "does not exist"
        raise OutputRefused(f"{target}: target {what}; pass the merged model directory whose index to patch")
    src_r, tgt_r = Path(os.path.realpath(source)), Path(os.path.realpath(target))
    if tgt_r == src_r or src_r in tgt_r.parents:
        raise OutputRefused(
            f"{target}: target is {'the source checkpoint itself' if tgt_r == src_r else 'inside the source'}"
            f" ({source}); the patch would rewrite the input: patch the merged output of hybrid_merge.py"
        )


def plan_mtp_patch(source: Path, target: Path, extra_file: str = EXTRA_FILE) -> tuple[MtpPatchResult, dict]:
    """What the patch would do, and the new index document (not written).

    The target must be a directory of the toolkit's (a hybrid_merge.py output, a fetched copy), other
    than the source: a directory someone else made is refused when the patch would change it.
    """
    _check_mtp_target(source, target)
    src_extra = source / extra_file
    if not src_extra.is_file():
        raise CheckpointError(
            f"{src_extra}: MTP extra file missing; download the INT4 checkpoint completely "
            f"(it must contain {extra_file})"
        )
    try:
        header = read_header(src_extra)
    except SafetensorsError as exc:
        raise CheckpointError(str(exc)) from None
    names = [n for n in header.tensors if is_mtp(n)]
    if not names:
        raise CheckpointError(f"{src_extra}: holds no mtp.* tensors")
    tgt_extra = target / extra_file
    copy_needed = True
    if tgt_extra.is_file():
        try:
            copy_needed = read_header(tgt_extra).digest != header.digest or (
                tgt_extra.stat().st_size != header.file_size
            )
        except SafetensorsError:
            copy_needed = True
    doc = _index_doc(target)
    wm: dict[str, str] = dict(doc["weight_map"])  # type: ignore[arg-type]
    meta = dict(doc.get("metadata") or {})  # type: ignore[arg-type]
    before_total = meta.get("total_size")
    entries_before = len(wm)
    added = sum(1 for n in names if n not in wm)
    for n in names:
        wm[n] = extra_file
    # Names claimed by the extra file but no longer in it would break loading: drop them.
    for n in [k for k, v in wm.items() if v == extra_file and k not in header.tensors]:
        del wm[n]
    total = _total_size(target, wm, (extra_file, header))
    meta["total_size"] = total
    new_doc = dict(doc)
    new_doc["metadata"] = meta
    new_doc["weight_map"] = dict(sorted(wm.items()))
    index_changed = new_doc["weight_map"] != doc["weight_map"] or before_total != total
    result = MtpPatchResult(
        changed=index_changed or copy_needed,
        added=added,
        copied=copy_needed,
        linked=False,
        total_size_before=before_total if isinstance(before_total, int) else None,
        total_size_after=total,
        entries_before=entries_before,
        entries_after=len(wm),
        mtp_tensors=len(names),
    )
    if result.changed and not made_by_toolkit(target, legacy=(MERGE_RECORD, SOURCE_RECORD)):
        raise OutputRefused(
            f"{target}: target was not created by this toolkit (no {OWNER_MARKER}); the patch would rewrite "
            f"its index{' and replace ' + extra_file if copy_needed and tgt_extra.exists() else ''}: "
            "patch the output of hybrid_merge.py, or a copy made with fetch_checkpoint.py mirror"
        )
    return result, new_doc


def apply_mtp_patch(source: Path, target: Path, extra_file: str = EXTRA_FILE) -> MtpPatchResult:
    result, new_doc = plan_mtp_patch(source, target, extra_file)
    if result.copied:
        result.linked = place_atomic(source / extra_file, target / extra_file)
    if result.changed:
        write_json_atomic(target / INDEX_NAME, new_doc)
    return result


# ------------------------------------------------------------------ verification


def block_range(n: int, s: int) -> tuple[int, float] | None:
    """Block sizes b with ceil(n / b) == s, as [lo, hi] (hi may be inf); None if impossible."""
    if n == 0 or s <= 0:
        return (1, math.inf) if n == 0 and s == 0 else None
    lo = -(-n // s)
    hi: float = math.inf if s == 1 else -(-n // (s - 1)) - 1
    if lo > hi or -(-n // lo) != s:
        return None
    return lo, hi


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    tensors: int = 0
    files: int = 0
    fp8_weights: int = 0
    mtp_tensors: int = 0
    block_size: int | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_fp8_scales(table: Mapping[str, TensorSource], report: VerifyReport) -> None:
    lo: float = 1
    hi: float = math.inf
    for name, src in sorted(table.items()):
        if src.info.dtype != FP8_DTYPE or not name.endswith(".weight"):
            continue
        report.fp8_weights += 1
        scale = table.get(scale_name(name))
        if scale is None:
            report.problems.append(f"{src.file}: FP8 weight {name} has no {scale_name(name)} partner")
            continue
        w, s = src.info.shape, scale.info.shape
        if len(w) != len(s):
            report.problems.append(
                f"{scale.file}: {scale.info.name} shape {list(s)} rank differs from {list(w)}"
            )
            continue
        for n, k in zip(w, s, strict=True):
            r = block_range(n, k)
            if r is None:
                report.problems.append(
                    f"{scale.file}: {scale.info.name} shape {list(s)} fits no block size for weight {list(w)}"
                )
                break
            lo, hi = max(lo, r[0]), min(hi, r[1])
    if report.fp8_weights and lo > hi:
        report.problems.append("FP8 scale shapes do not share one block size across the checkpoint")
    elif report.fp8_weights and lo <= hi:
        report.block_size = 128 if lo <= 128 <= hi else int(lo)


TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")


def tokenizer_tokens(directory: Path) -> set[str] | None:
    """The token strings of the checkpoint's tokenizer.json (vocabulary and added tokens); None
    when there is no readable tokenizer.json."""
    try:
        doc = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    model = doc.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    tokens = set(vocab) if isinstance(vocab, dict) else set()
    for added in doc.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str):
            tokens.add(added["content"])
    return tokens


def check_tool_tokens(directory: Path) -> list[str]:
    """Problems that stop vLLM's Qwen tool-call parsers (qwen3_coder, qwen3_xml, hermes): without
    these tokens in the tokenizer, a server started with --enable-auto-tool-choice answers HTTP 500
    to every chat request, with tools or without (seen on vLLM 0.20.0)."""
    tokens = tokenizer_tokens(directory)
    if tokens is None:
        return [f"{directory}/tokenizer.json: missing or unreadable; the tool-call tokens cannot be checked"]
    missing = [t for t in TOOL_CALL_TOKENS if t not in tokens]
    if not missing:
        return []
    return [f"{directory}/tokenizer.json: no {' / '.join(missing)} token: with tool calling on, vLLM answers "
            f"HTTP 500 to every chat request; use the model's own tokenizer, or set "
            f"vllm_enable_auto_tool_choice: false"]


_FLOAT_FORMATS = {"F32": ("f", 4), "F16": ("e", 2)}


def _floats(src: TensorSource) -> list[float]:
    import struct

    off, n = src.header.absolute(src.info.name)
    with open(src.header.path, "rb") as f:
        f.seek(off)
        raw = f.read(n)
    if src.info.dtype == "BF16":  # the high half of an F32
        return list(struct.unpack(f"<{n // 2}f", b"".join(b"\0\0" + raw[i:i + 2] for i in range(0, n, 2))))
    code, size = _FLOAT_FORMATS[src.info.dtype]
    return list(struct.unpack(f"<{n // size}{code}", raw))


def check_fp8_scales_against(table: Mapping[str, TensorSource], fp8_dir: Path,
                             rtol: float = 1e-3) -> list[str]:
    """Problems where an FP8 weight's ``weight_scale_inv`` differs from the FP8 source's.

    A merge copies the FP8 tensors; a scale that shrank or grew (a wrong dtype cast, a scale applied
    twice, the 1/16 of the GPU run's negative control) dequantizes every weight of the layer wrongly
    while shapes and names still pass, and at the tiny model's size the served text barely changes."""
    source = load_fp8_table(fp8_dir)
    problems = []
    for name, src in sorted(table.items()):
        if src.info.dtype != FP8_DTYPE or not name.endswith(".weight") or scale_name(name) not in table:
            continue
        ours, ref = table[scale_name(name)], source.get(scale_name(name))
        if ref is None:
            problems.append(f"{ours.file}: {ours.info.name} is not in the FP8 source {fp8_dir}")
            continue
        if (ours.info.shape, ours.info.dtype) != (ref.info.shape, ref.info.dtype) or ours.info.dtype not in (
                *_FLOAT_FORMATS, "BF16"):
            problems.append(f"{ours.file}: {ours.info.name} is {ours.info.dtype} {list(ours.info.shape)}, "
                            f"the FP8 source's {ref.info.dtype} {list(ref.info.shape)}")
            continue
        pairs = [(a, b) for a, b in zip(_floats(ours), _floats(ref), strict=True)
                 if a != b and not (math.isnan(a) and math.isnan(b))]  # a NaN copied is the same NaN
        bad = [(a, b) for a, b in pairs if not math.isclose(a, b, rel_tol=rtol)]
        if bad:
            ratios = sorted(a / b for a, b in bad if b)
            mid = ratios[len(ratios) // 2] if ratios else float("nan")
            problems.append(f"{ours.file}: {ours.info.name}: {len(bad)} scales differ from the FP8 source's "
                            f"(median ratio {mid:.4g}); re-run the merge from the FP8 source")
    return problems


def verify_checkpoint(directory: Path, expect_mtp: bool = False, expect_hybrid: bool = False,
                      expect_tool_tokens: bool = False, fp8_source: Path | None = None,
                      int4_source: Path | None = None) -> VerifyReport:
    report = VerifyReport()
    if expect_tool_tokens:
        report.problems.extend(check_tool_tokens(directory))
    idx_path = directory / INDEX_NAME
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    report.files = len(files)
    headers: dict[str, Header] = {}
    for f in files:
        try:
            headers[f.name] = read_header(f)
        except SafetensorsError as exc:
            report.problems.append(str(exc))
    if not files:
        report.problems.append(f"{directory}: no *.safetensors files")
    index = None
    if idx_path.is_file():
        try:
            index = read_index(idx_path)
        except SafetensorsError as exc:
            report.problems.append(str(exc))
    elif len(files) > 1:
        report.problems.append(f"{idx_path}: missing (more than one safetensors file)")
    listed: set[str] = set(index.files) if index else {f.name for f in files}
    if index:
        for fname in index.files:
            if fname not in headers and not (directory / fname).is_file():
                report.problems.append(f"{idx_path}: lists {fname}, which does not exist")
        for name, fname in sorted(index.weight_map.items()):
            h = headers.get(fname)
            if h is not None and name not in h.tensors:
                report.problems.append(f"{idx_path}: {name} mapped to {fname}, which does not hold it")
        for fname, h in sorted(headers.items()):
            if fname not in listed:
                report.problems.append(f"{directory / fname}: present but not listed in {INDEX_NAME}")
                continue
            for name in h.tensors:
                mapped = index.weight_map.get(name)
                if mapped is None:
                    report.problems.append(f"{directory / fname}: tensor {name} not in weight_map")
                elif mapped != fname:
                    report.problems.append(f"{directory / fname}: tensor {name} mapped to {mapped} instead")
        expected = sum(t.nbytes for f, h in headers.items() if f in listed for t in h.tensors.values())
        if index.total_size != expected:
            report.problems.append(
                f"{idx_path}: metadata.total_size {index.total_size} != sum of tensor bytes {expected}"
            )
    try:
        table = tensor_table({f: h for f, h in headers.items() if f in listed})
    except CheckpointError as exc:
        report.problems.append(str(exc))
        table = {}
    report.tensors = len(table)
    mtp_registered = [n for n in (index.weight_map if index else table) if is_mtp(n)]
    report.mtp_tensors = len(mtp_registered)
    if expect_mtp:
        extra = headers.get(EXTRA_FILE)
        if not mtp_registered:
            report.problems.append(f"{idx_path}: no mtp.* tensors registered (expected MTP head)")
        if extra is not None and index is not None:
            missing = [n for n in extra.tensors if is_mtp(n) and n not in index.weight_map]
            if missing:
                report.problems.append(
                    f"{idx_path}: {len(missing)} mtp.* tensors of {EXTRA_FILE} not registered"
                )
    _check_fp8_scales(table, report)
    if expect_hybrid:
        if report.fp8_weights == 0:
            report.problems.append(f"{directory}: no F8_E4M3 weights (expected a hybrid checkpoint)")
        for name, src in sorted(table.items()):
            if src.info.dtype == FP8_DTYPE and is_expert(name):
                report.problems.append(f"{src.file}: expert tensor {name} is FP8 (hybrid keeps experts INT4)")
    fp8: dict[str, TensorInfo] | None = None
    if fp8_source is not None:
        try:
            report.problems.extend(check_fp8_scales_against(table, fp8_source))
            fp8 = {n: s.info for n, s in load_fp8_table(fp8_source).items()}
        except (CheckpointError, OSError) as exc:
            report.problems.append(f"{fp8_source}: cannot read the FP8 source: {exc}")
    if int4_source is not None or fp8 is not None:  # the output against its inputs' indexes
        scales = {scale_name(n) for n, s in table.items() if s.info.dtype == FP8_DTYPE}
        report.problems.extend(output_problems(directory, {n: s.info for n, s in table.items()}, scales,
                                               int4_source, fp8, fp8_source, EXTRA_FILE))
    return report


def read_source_record(directory: Path) -> dict[str, object]:
    """The ``.sparkllm_source.json`` written by fetch_checkpoint.py, or {}."""
    p = directory / SOURCE_RECORD
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def index_for(headers: Mapping[str, Header]) -> dict[str, object]:
    try:
        return build_index(headers)
    except SafetensorsError as exc:
        raise CheckpointError(str(exc)) from None


def plan_index(plan: MergePlan) -> dict[str, object]:
    """Index document of a merge plan's output (names are unique by construction)."""
    weight_map = {t.name: s.name for s in plan.shards for t in s.tensors}
    return {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(weight_map.items()))}
