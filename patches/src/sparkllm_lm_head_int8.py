# SPDX-License-Identifier: Apache-2.0
# Written for spark-llm-toolkit (patch 0002); see patches/README.md there.
"""Opt-in INT8 LM head: per-row symmetric INT8 weight, logits from a kernel that reads it.

Enabled by SPARKLLM_LM_HEAD_INT8=1 in the server's environment; unset (or 0) nothing here
runs. After a model's weights are loaded and processed, every ParallelLMHead whose weight is
unquantized, floating point and used by no other module (a tied input embedding is never
touched) is replaced by:

- ``weight``: int8 [rows, cols], q = round(w / s) clamped to [-127, 127],
- ``weight_scale``: float32 [rows], s = max|w_row| / 127 (1.0 for an all-zero padding row),

and its quant_method by Int8LMHeadMethod, whose apply() computes x @ (q * s)^T:

- CUDA: a Triton kernel (this file) that streams the int8 weight once per block of tokens,
  converts it to the activations' dtype in registers (exact), runs the tile product with fp32
  accumulation and scales each output column (a decode step reads half the bytes of the BF16
  head),
- CPU: torch.ops.aten._weight_int8pack_mm in fp32 (torch's CUDA version of that op is a naive
  one-thread-per-output kernel, so it is not used on CUDA).

Before the BF16 weight is dropped, the kernel is checked on the device against the dequantized
weight on random inputs; on any error or disagreement the head stays BF16 and a warning says
why. One INFO line per quantized head reports shape, kernel and errors.

The Triton kernel's tiles are autotuned for the device at load (before CUDA-graph capture): for
each bucket of token counts (TUNE_BUCKETS) a few candidate tiles are timed with CUDA events on
the real quantized weight, checked against the fixed table's output, and the fastest is kept for
the process (fixed from then on). The choice is cached as JSON in SPARKLLM_LM_HEAD_INT8_TUNE_DIR
(keyed by GPU, compute capability, shape, dtype, Triton version and the candidates): a cache hit
skips the timing; a corrupt or unwritable cache is logged and ignored. SPARKLLM_LM_HEAD_INT8_TUNE=0
keeps the fixed table (tiles measured on an H200). One INFO line says which tiles and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import tempfile
import time
from typing import NamedTuple

import torch
from torch.nn import Parameter
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

logger = init_logger(__name__)

ENV = "SPARKLLM_LM_HEAD_INT8"
# auto (default): triton on CUDA, torch on CPU. triton/torch force one (tests; triton on CPU
# needs TRITON_INTERPRET=1).
KERNEL_ENV = "SPARKLLM_LM_HEAD_INT8_KERNEL"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_CHUNK_ROWS = 8192  # rows quantized at a time (bounds the fp32 temporary)
_CHECK_ROWS = 4096  # rows of the reference product in the load-time check
_CHECK_TOKENS = 8
_CHECK_TOLERANCE = 0.02  # kernel vs dequantized reference, relative to max |logit|
# Autotune: on (default) unless this is 0/false/no/off; where its JSON cache lives (unset: not cached).
TUNE_ENV = "SPARKLLM_LM_HEAD_INT8_TUNE"
TUNE_DIR_ENV = "SPARKLLM_LM_HEAD_INT8_TUNE_DIR"
_TUNE_SCHEMA = 1  # bump when the kernel changes: an old cache file then misses


def enabled() -> bool:
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(
        f"{ENV}={os.environ.get(ENV)!r} is not a boolean: set it to 1 to serve the LM head in "
        "INT8, or 0 / unset it to keep the checkpoint's dtype"
    )


def quantize_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(int8 weight, float32 scale per row, max |w - q * s|, max |w|), in chunks of rows."""
    rows = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, dtype=torch.float32, device=weight.device)
    max_err = torch.zeros((), dtype=torch.float32, device=weight.device)
    max_abs = torch.zeros((), dtype=torch.float32, device=weight.device)
    for start in range(0, rows, _CHUNK_ROWS):
        w = weight[start : start + _CHUNK_ROWS].float()
        amax = w.abs().amax(dim=1)
        if not bool(torch.isfinite(amax).all()):
            raise ValueError(f"non-finite weights in rows {start}..{start + len(amax) - 1}")
        s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        qc = torch.round(w / s[:, None]).clamp_(-127, 127)
        max_err = torch.maximum(max_err, (w - qc * s[:, None]).abs().max())
        max_abs = torch.maximum(max_abs, amax.max())
        q[start : start + _CHUNK_ROWS] = qc.to(torch.int8)
        scale[start : start + _CHUNK_ROWS] = s
    return q, scale, float(max_err), float(max_abs)


# --- kernels -------------------------------------------------------------------------------------

_triton_kernel = None


def _build_triton_kernel():
    import triton
    import triton.language as tl

    # M (tokens) varies every step: not specialized, so one compiled variant per tile choice
    @triton.jit(do_not_specialize=["M"])
    def int8_logits_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0)
            # int8 -> x's dtype is exact (|q| <= 127); via fp32 because Triton's interpreter
            # converts int8 to bf16 wrongly. Products are exact, the sum is fp32.
            wf = w.to(tl.float32)
            if FP32_DOT:  # the interpreter (CPU tests): its bf16 dot is wrong too
                acc = tl.dot(x.to(tl.float32), tl.trans(wf), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(wf.to(x.dtype)), acc)
        s = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
        acc = acc * s[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return int8_logits_kernel


class Tile(NamedTuple):
    """One launch configuration of the Triton kernel."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int  # 3 is Triton's default on CUDA (triton/backends/nvidia/compiler.py:109, 3.6.0)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.warps}/s{self.stages}"


def fixed_tile(m: int) -> Tile:
    """The table measured on an H200 (vocab 248320 x 3072, bf16 in): M <= 32 streams the weight at
    ~3.8 TB/s (about 1.9x faster than the BF16 GEMM); above 64 tokens the kernel is compute-bound and
    slower than cuBLAS BF16 (1.3x at 128, 1.7x at 256 there). Used when the autotune is off or fails."""
    if m <= 32:
        return Tile(16 if m <= 16 else 32, 64, 256, 4, 3)
    if m <= 64:
        return Tile(64, 128, 64, 4, 3)
    return Tile(128, 256, 64, 8, 3)


# Token counts a decode step can have (max_num_seqs x (1 + speculative tokens); the logits are taken
# for sampled positions only): a step of m tokens uses the smallest bucket >= m, above the last one
# the last one's tiles.
TUNE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Candidates (the fixed table's tiles among them): tile heights that fit the bucket, a few widths,
# depths, warps and pipeline stages. tl.dot needs a tile height of at least 16.
CANDIDATES = (
    Tile(16, 64, 256, 4, 3), Tile(16, 32, 256, 4, 3), Tile(16, 128, 128, 4, 3), Tile(16, 64, 128, 4, 4),
    Tile(16, 64, 512, 4, 2), Tile(16, 128, 256, 8, 3),
    Tile(32, 64, 256, 4, 3), Tile(32, 128, 128, 4, 3), Tile(32, 64, 128, 4, 4),
    Tile(64, 128, 64, 4, 3), Tile(64, 128, 128, 8, 3), Tile(64, 64, 128, 4, 3),
    Tile(128, 256, 64, 8, 3), Tile(128, 128, 64, 8, 3), Tile(128, 128, 128, 8, 3),
)
_TUNE_WARMUP = 3
_TUNE_REPS = 15


def bucket_for(m: int, buckets: tuple[int, ...] = TUNE_BUCKETS) -> int:
    """The bucket whose tiles serve a step of m tokens."""
    for b in buckets:
        if m <= b:
            return b
    return buckets[-1]


def candidates_for(bucket: int) -> list[Tile]:
    """The candidates timed for a bucket: those whose tile height suits its token count."""
    if bucket <= 16:
        heights = {16}
    elif bucket <= 32:
        heights = {16, 32}
    elif bucket <= 64:
        heights = {32, 64}
    else:
        heights = {64, 128}
    return [t for t in CANDIDATES if t.block_m in heights]


def pick_fastest(timings: dict[int, dict[Tile, float]]) -> dict[int, Tile]:
    """Per bucket, the candidate with the least time (the first listed on a tie); a bucket with no
    timed candidate keeps the fixed table's tile."""
    chosen = {}
    for bucket in TUNE_BUCKETS:
        times = timings.get(bucket) or {}
        ok = [(t, c) for c, t in times.items() if t is not None and t == t and t > 0]
        chosen[bucket] = min(ok, key=lambda tc: (tc[0], CANDIDATES.index(tc[1])))[1] if ok \
            else fixed_tile(bucket)
    return chosen


def tune_enabled() -> bool:
    raw = os.environ.get(TUNE_ENV, "").strip().lower()
    if raw in ("0", "false", "no", "off"):
        return False
    if raw == "" or raw in _TRUE:
        return True
    logger.warning("sparkllm: %s=%r is not a boolean (1 to autotune the lm_head INT8 tiles, 0 for the "
                   "fixed table): using the fixed table", TUNE_ENV, os.environ.get(TUNE_ENV))
    return False


def tune_key(gpu: str, capability: tuple[int, int], n: int, k: int, dtype: str,
             triton_version: str) -> dict:
    """What a cached choice is valid for: the device, the shape, the activations' dtype, the compiler
    and the candidate list (a change of any of them misses the cache)."""
    return {"schema": _TUNE_SCHEMA, "gpu": gpu, "capability": f"{capability[0]}.{capability[1]}",
            "n": int(n), "k": int(k), "dtype": str(dtype).replace("torch.", ""),
            "triton": triton_version, "buckets": list(TUNE_BUCKETS),
            "candidates": [list(t) for t in CANDIDATES]}


def tune_cache_file(directory: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(directory, f"sparkllm-lm-head-int8-tiles-{digest}.json")


def load_tune_cache(path: str, key: dict) -> dict[int, Tile] | None:
    """The cached choice, or None when there is no file; a file that is not a valid choice for this key
    is logged and ignored (the caller tunes again)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("sparkllm: lm_head INT8 tile cache %s unreadable (%s): ignored", path, e)
        return None
    try:
        if doc["key"] != key:
            raise ValueError("its key is not this device's, shape's or candidates'")
        tiles = {int(b): Tile(*(int(v) for v in t)) for b, t in doc["tiles"].items()}
        if set(tiles) != set(TUNE_BUCKETS) or not set(tiles.values()) <= set(CANDIDATES):
            raise ValueError("its buckets or tiles are not this version's")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        logger.warning("sparkllm: lm_head INT8 tile cache %s is not a valid choice (%s): ignored", path, e)
        return None
    return tiles


def save_tune_cache(path: str, key: dict, tiles: dict[int, Tile], timings: dict) -> bool:
    """Write the choice atomically (temporary file, fsync, rename); False, with a warning, if it cannot."""
    doc = {"key": key, "tiles": {str(b): list(t) for b, t in sorted(tiles.items())},
           "timings_us": {str(b): {str(t): round(us, 1) for t, us in ts.items() if us is not None}
                          for b, ts in sorted(timings.items())},
           "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    directory = os.path.dirname(path) or "."
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tiles-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except OSError as e:
        logger.warning("sparkllm: lm_head INT8 tile cache %s not written (%s): the choice holds for this "
                       "process only", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return False


# (rows, cols, dtype, device) -> tiles per bucket, set once per shape at load (before CUDA-graph
# capture) and never changed afterwards
_TUNED: dict[tuple, dict[int, Tile]] = {}


def _time_tile(x, q, scale, tile: Tile) -> float:
    """Median microseconds of one launch with this tile (CUDA events)."""
    for _ in range(_TUNE_WARMUP):
        _triton_logits(x, q, scale, tile)
    times = []
    for _ in range(_TUNE_REPS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        _triton_logits(x, q, scale, tile)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def autotune(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> dict[int, dict[Tile, float]]:
    """Time every bucket's candidates on this weight; a candidate that fails to compile or run, or
    whose logits disagree with the fixed tile's, is left out (None)."""
    n, k = q.shape
    gen = torch.Generator(device=q.device).manual_seed(0)
    timings: dict[int, dict[Tile, float]] = {}
    for bucket in TUNE_BUCKETS:
        x = torch.randn(bucket, k, generator=gen, device=q.device, dtype=torch.float32).to(dtype)
        ref = _triton_logits(x, q, scale, fixed_tile(bucket)).float()
        bound = _CHECK_TOLERANCE * float(ref.abs().max().clamp_min(1e-30))
        timings[bucket] = {}
        for tile in candidates_for(bucket):
            try:
                out = _triton_logits(x, q, scale, tile).float()
                if not float((out - ref).abs().max()) <= bound:
                    raise ValueError("logits disagree with the fixed tile's")
                timings[bucket][tile] = _time_tile(x, q, scale, tile)
            except Exception as e:  # out of shared memory, compile error, disagreement: skip it
                logger.debug("sparkllm: lm_head INT8 tile %s for M<=%d left out: %s", tile, bucket, e)
                timings[bucket][tile] = None
        del x, ref
    return timings


def _describe(tiles: dict[int, Tile]) -> str:
    return ", ".join(f"M<={b}: {t}" for b, t in sorted(tiles.items()))


def tune_tiles(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Choose the tiles for this head's shape on its device (cache, else timing, else the fixed table)
    and log the choice in one INFO line. Never raises: the fixed table is always usable."""
    n, k = q.shape
    slot = (n, k, dtype, q.device)
    if slot in _TUNED or q.device.type != "cuda":
        return
    if not tune_enabled():
        _TUNED[slot] = {b: fixed_tile(b) for b in TUNE_BUCKETS}
        logger.info("sparkllm: lm_head INT8 tiles for %dx%d: fixed table (%s off): %s", n, k, TUNE_ENV,
                    _describe(_TUNED[slot]))
        return
    started = time.perf_counter()
    try:
        import triton

        props = torch.cuda.get_device_properties(q.device)
        key = tune_key(props.name, (props.major, props.minor), n, k, str(dtype), triton.__version__)
        directory = os.environ.get(TUNE_DIR_ENV, "").strip()
        path = tune_cache_file(directory, key) if directory else None
        tiles = load_tune_cache(path, key) if path else None
        if tiles is not None:
            _TUNED[slot] = tiles
            logger.info("sparkllm: lm_head INT8 tiles for %dx%d on %s: %s, from cache %s", n, k, props.name,
                        _describe(tiles), path)
            return
        timings = autotune(q, scale, dtype)
        tiles = pick_fastest(timings)
        saved = save_tune_cache(path, key, tiles, timings) if path else False
    except Exception as e:  # the fixed table is always there
        _TUNED[slot] = {b: fixed_tile(b) for b in TUNE_BUCKETS}
        logger.warning("sparkllm: lm_head INT8 tile autotune failed (%s: %s): fixed table",
                       type(e).__name__, e)
        return
    _TUNED[slot] = tiles
    where = f"cached in {path}" if saved else (f"not cached: {TUNE_DIR_ENV} unset" if not path else
                                                 "not cached")
    logger.info("sparkllm: lm_head INT8 tiles for %dx%d on %s: %s, autotuned in %.1f s (%s)", n, k,
                props.name, _describe(tiles), time.perf_counter() - started, where)


def tile_for(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Tile:
    """The tile a step of m tokens launches with: the tuned one for this shape, else the fixed table."""
    tiles = _TUNED.get((n, k, dtype, device))
    return tiles[bucket_for(m)] if tiles else fixed_tile(m)


def _triton_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   tile: Tile | None = None) -> torch.Tensor:
    global _triton_kernel
    import triton

    if _triton_kernel is None:
        _triton_kernel = _build_triton_kernel()
    m, k = x.shape
    n = q.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if tile is None:
        tile = tile_for(m, n, k, x.dtype, x.device)
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m))
    _triton_kernel[grid](
        x, q, scale, out, m, n, k, x.stride(0), out.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        FP32_DOT=os.environ.get("TRITON_INTERPRET", "0") == "1", num_warps=tile.warps,
        num_stages=tile.stages,
    )
    return out


def _torch_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x.float(), q, scale).to(x.dtype)


_KERNELS = {"triton": _triton_logits, "torch": _torch_logits}


def int8_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, kernel: str) -> torch.Tensor:
    """x [..., K] @ (q * scale[:, None])^T in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _KERNELS[kernel](x2, q, scale).reshape(*lead, q.shape[0])


def pick_kernel(device: torch.device) -> tuple[str | None, str]:
    """(kernel name or None, why)."""
    forced = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if forced not in ("auto", *_KERNELS):
        raise ValueError(f"{KERNEL_ENV}={forced!r}: use auto, triton or torch")
    if forced != "auto":
        return forced, f"forced by {KERNEL_ENV}"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return None, f"Triton is not importable ({e})"
        return "triton", "CUDA"
    if device.type == "cpu":
        return "torch", "CPU"
    return None, f"no INT8 LM head kernel for device type {device.type!r}"


class Int8LMHeadMethod(QuantizeMethodBase):
    """Logits from an int8 weight with one float32 scale per output row."""

    def __init__(self, kernel: str):
        self.kernel = kernel

    def create_weights(self, layer, *args, **kwargs):  # never built from a config
        raise RuntimeError("Int8LMHeadMethod replaces a loaded LM head; it creates no weights")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return  # already int8 (reloading runs quantize_lm_heads again, which skips int8 heads)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        out = int8_logits(x, layer.weight, layer.weight_scale, self.kernel)
        if bias is not None:
            out = out + bias
        return out

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an INT8 LM head is not an input embedding")


# --- load-time pass -------------------------------------------------------------------------------

def _storage_key(t: torch.Tensor):
    return None if t.is_meta else (t.device, t.untyped_storage().data_ptr())


def _check_kernel(weight, q, scale, kernel) -> tuple[float, float]:
    """(kernel error relative to max |logit|, max |logit error| vs the original weight)."""
    rows, cols = q.shape
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(_CHECK_TOKENS, cols, generator=gen, device=weight.device,
                    dtype=torch.float32).to(weight.dtype)
    out = int8_logits(x, q, scale, kernel)
    # integer steps: the loader runs with a 16-bit default dtype (a float linspace rounds)
    idx = torch.arange(0, rows, max(1, rows // _CHECK_ROWS), device=weight.device)
    ref_q = x.float() @ (q[idx].float() * scale[idx, None]).t()
    ref_w = x.float() @ weight[idx].float().t()
    kernel_err = (out[:, idx].float() - ref_q).abs().max() / ref_q.abs().max().clamp_min(1e-30)
    return float(kernel_err), float((ref_q - ref_w).abs().max())


def _quantize_head(model_name: str, name: str, head, kernel: str) -> None:
    weight = head.weight
    rows, cols = weight.shape
    q, scale, w_err, w_max = quantize_per_row(weight)
    if kernel == "triton":
        tune_tiles(q, scale, weight.dtype)  # before the check, so the check runs the chosen tiles
    kernel_err, logit_err = _check_kernel(weight, q, scale, kernel)
    if not kernel_err <= _CHECK_TOLERANCE:
        raise RuntimeError(
            f"kernel {kernel} disagrees with the dequantized weight: relative error "
            f"{kernel_err:.3g} > {_CHECK_TOLERANCE}")
    bf16_mib = weight.numel() * weight.element_size() / 2**20
    old_dtype = weight.dtype
    head.weight = Parameter(q, requires_grad=False)
    head.weight_scale = Parameter(scale, requires_grad=False)
    if hasattr(head, "cpu_linear"):  # CPU platform: its GEMM closure holds the old weight
        del head.cpu_linear
    head.quant_method = Int8LMHeadMethod(kernel)
    logger.info(
        "sparkllm: lm_head INT8 (per-row), %dx%d in %s (%s), kernel %s, weight max abs err "
        "%.3g (max |w| %.3g), check logits max abs err %.3g vs %s, %.1f MiB -> %.1f MiB",
        rows, cols, model_name, name, kernel, w_err, w_max, logit_err,
        str(old_dtype).replace("torch.", ""), bf16_mib, (q.numel() + 4 * rows) / 2**20)


def quantize_lm_heads(model: torch.nn.Module) -> int:
    """Quantize the model's eligible LM heads in place; returns how many were quantized."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    model_name = type(model).__name__
    if os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() not in ("", "0"):
        logger.warning("sparkllm: lm_head INT8 skipped in %s: VLLM_BATCH_INVARIANT is set",
                       model_name)
        return 0
    # How many registrations each parameter storage has across the model: an LM head whose
    # weight is also registered elsewhere (tied input embedding, another head) is left alone.
    uses: dict[object, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            key = _storage_key(p)
            uses[key] = uses.get(key, 0) + 1
    done = 0
    for name, head in model.named_modules():
        if not isinstance(head, ParallelLMHead):
            continue
        weight = getattr(head, "weight", None)
        why = None
        if type(head.quant_method) is not UnquantizedEmbeddingMethod:
            why = f"its quant method is {type(head.quant_method).__name__}"
        elif not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.is_meta:
            why = "it has no loaded 2-D weight"
        elif not weight.is_floating_point():
            why = f"its weight is {weight.dtype}"
        elif uses.get(_storage_key(weight), 0) > 1:
            why = "its weight is shared with another module (tied embedding): left unquantized"
        if why is not None:
            logger.info("sparkllm: lm_head INT8 skipped for %s (%s): %s", model_name, name, why)
            continue
        kernel, reason = pick_kernel(weight.device)
        if kernel is None:
            logger.warning("sparkllm: lm_head INT8 unavailable for %s (%s): %s; keeping %s",
                           model_name, name, reason, weight.dtype)
            continue
        try:
            _quantize_head(model_name, name, head, kernel)
        except Exception as e:  # non-finite weights, kernel failed or disagreed: keep the original
            logger.warning("sparkllm: lm_head INT8 unavailable for %s (%s): %s: %s; keeping %s",
                           model_name, name, type(e).__name__, e, weight.dtype)
            continue
        done += 1
    if done and torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the BF16 heads' memory back before KV cache sizing
    return done
