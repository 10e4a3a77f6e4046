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
"""

from __future__ import annotations

import os

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


def _triton_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    global _triton_kernel
    import triton

    if _triton_kernel is None:
        _triton_kernel = _build_triton_kernel()
    m, k = x.shape
    n = q.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    # Tiles measured on an H200 (vocab 248320 x 3072, bf16 in): M <= 32 streams the weight
    # at ~3.8 TB/s (about 1.9x faster than the BF16 GEMM); above 64 tokens the kernel is
    # compute-bound and slower than cuBLAS BF16 (1.3x at 128, 1.7x at 256 there).
    if m <= 32:
        block_m, block_n, block_k, warps = (16 if m <= 16 else 32), 64, 256, 4
    elif m <= 64:
        block_m, block_n, block_k, warps = 64, 128, 64, 4
    else:
        block_m, block_n, block_k, warps = 128, 256, 64, 8
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _triton_kernel[grid](
        x, q, scale, out, m, n, k, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_DOT=os.environ.get("TRITON_INTERPRET", "0") == "1", num_warps=warps,
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
