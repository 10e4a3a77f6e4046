"""What a merge may trust in its inputs, and what its output owes them (standard library only).

- ``index_problems``: a checkpoint's ``model.safetensors.index.json`` names every shard, and every tensor
  is in the file the index says (and, for the INT4 input, every tensor of every shard is in the index).
  A shard deleted or never downloaded is found here: rebuilding the output's index from what was written
  would hide it.
- ``other_fp8_types``: FP8 tensors of another type than F8_E4M3 (F8_E5M2, F8_E8M0). Qwen's FP8 release is
  e4m3 with 128x128 block scales, and vLLM 0.19.1's Fp8LinearMethod only supports float8_e4m3fn
  (vllm/model_executor/layers/quantization/fp8.py:265); skipping such a weight silently would give a
  hybrid with fewer FP8 layers than planned.
- ``output_problems``: a merged output holds exactly the tensors of the INT4 index (plus the scales of
  the FP8 weights that replaced some of them), and every FP8 weight is the FP8 input's, same shape.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

from .safetensors_io import INDEX_NAME, Header, SafetensorsError, TensorInfo, read_header, read_index

FP8_DTYPE = "F8_E4M3"
REFETCH = "the checkpoint is incomplete or damaged: fetch it again (delete the directory to refetch it)"


def _some(names: Collection[str], n: int = 3) -> str:
    first = sorted(names)[:n]
    return ", ".join(first) + (f" and {len(names) - n} more" if len(names) > n else "")


def index_problems(directory: Path, headers: Mapping[str, Header], unlisted_ok: Collection[str] = (),
                   every_tensor_listed: bool = True) -> list[str]:
    """Where the index of ``directory`` and its shard files disagree; ``headers`` are the shards that are
    present, by file name. Files in ``unlisted_ok`` may hold tensors the index does not name (the INT4
    checkpoint's MTP extra file is not in its index). Without an index, a checkpoint of more than one
    shard is a problem: nothing says that every shard is there."""
    idx = directory / INDEX_NAME
    if not idx.is_file():
        shards = [f for f in headers if f not in unlisted_ok]
        if len(shards) > 1:
            return [f"{idx}: missing, and {directory} holds {len(shards)} shards: nothing says every shard "
                    f"is there; {REFETCH}"]
        return []
    try:
        index = read_index(idx)
    except SafetensorsError as exc:
        return [f"{exc}; {REFETCH}"]
    problems: list[str] = []
    unsafe = [f for f in index.files if "/" in f or f in ("", ".", "..")]
    if unsafe:
        problems.append(f"{idx}: names files outside {directory}: {_some(unsafe)}; {REFETCH}")
    missing = [f for f in index.files if f not in headers and f not in unsafe]
    if missing:
        problems.append(f"{idx}: names {len(missing)} shard(s) missing from {directory}: {_some(missing)}; "
                        f"{REFETCH}")
    misplaced = [n for n, f in index.weight_map.items() if f in headers and n not in headers[f].tensors]
    if misplaced:
        first = sorted(misplaced)[0]
        problems.append(f"{idx}: {len(misplaced)} tensor(s) are not in the file it names, e.g. {first} "
                        f"(named in {index.weight_map[first]}); {REFETCH}")
    if every_tensor_listed:
        for fname, h in sorted(headers.items()):
            if fname in unlisted_ok:
                continue
            if fname not in index.files:
                problems.append(f"{directory / fname}: present but not named in {INDEX_NAME}; {REFETCH}")
                continue
            unlisted = [n for n in h.tensors if index.weight_map.get(n) != fname]
            if unlisted:
                problems.append(f"{directory / fname}: {len(unlisted)} tensor(s) the index places elsewhere "
                                f"or not at all, e.g. {sorted(unlisted)[0]}; {REFETCH}")
    return problems


def other_fp8_types(headers: Mapping[str, Header]) -> list[str]:
    """One line per FP8 tensor of a type other than F8_E4M3."""
    return [
        f"{h.path}: FP8 tensor {name} is {info.dtype}, expected {FP8_DTYPE} (Qwen's FP8 release; vLLM's FP8 "
        f"layers load only e4m3): pass Qwen's FP8 release (Qwen/Qwen3.5-122B-A10B-FP8) or its fp8-extract"
        for _f, h in sorted(headers.items())
        for name, info in h.tensors.items()
        if info.dtype.startswith("F8_") and info.dtype != FP8_DTYPE
    ]


def int4_names(int4_dir: Path, extra_file: str) -> set[str]:
    """The tensors the INT4 checkpoint promises: its index's names, plus those of its MTP extra file
    (which its index may not list); without an index, those of every shard. Raises SafetensorsError."""
    idx = int4_dir / INDEX_NAME
    names: set[str] = set()
    if idx.is_file():
        names |= set(read_index(idx).weight_map)
        extra = int4_dir / extra_file
        if extra.is_file():
            names |= set(read_header(extra).tensors)
        return names
    for f in sorted(int4_dir.glob("*.safetensors")):
        names |= set(read_header(f).tensors)
    return names


def output_problems(directory: Path, out: Mapping[str, TensorInfo], scales: Collection[str],
                    int4_dir: Path | None, fp8: Mapping[str, TensorInfo] | None, fp8_dir: Path | None,
                    extra_file: str) -> list[str]:
    """Where a merged output ``out`` (its tensors by name) and its inputs' indexes disagree: an INT4
    tensor missing, a tensor neither input names, an FP8 weight the FP8 input does not hold as such.
    ``scales`` are the scale names of the output's FP8 weights (added by the merge)."""
    problems: list[str] = []
    if int4_dir is not None:
        try:
            expected = int4_names(int4_dir, extra_file)
        except SafetensorsError as exc:
            return [f"--int4-source: {exc}"]
        missing = expected - set(out)
        if missing:
            problems.append(
                f"{directory}: {len(missing)} tensors of the INT4 checkpoint are missing (it holds "
                f"{len(out)}; the INT4 index and MTP file name {len(expected)}, plus {len(scales)} FP8 "
                f"scales), e.g. {_some(missing)}: merge again from the complete INT4 checkpoint {int4_dir}")
        strange = set(out) - expected - set(scales)
        if strange:
            problems.append(f"{directory}: {len(strange)} tensors that the INT4 checkpoint {int4_dir} does "
                            f"not name, e.g. {_some(strange)}: merge again from the right INT4 checkpoint")
    if fp8 is not None:
        for name, info in sorted(out.items()):
            if info.dtype != FP8_DTYPE:
                continue
            ref = fp8.get(name)
            if ref is None or (ref.dtype, ref.shape) != (info.dtype, info.shape):
                what = "does not hold it" if ref is None else f"holds it as {ref.dtype} {list(ref.shape)}"
                problems.append(f"{directory}: FP8 weight {name} {list(info.shape)}: the FP8 source "
                                f"{fp8_dir} {what}: merge again from the FP8 checkpoint it came from")
    return problems
