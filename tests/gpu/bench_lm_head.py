#!/usr/bin/env python3
"""Time our INT8 LM head kernel against the BF16 matmul it replaces, in the same run, on a CUDA GPU.

    python3 tests/gpu/bench_lm_head.py [--rows 248320] [--cols 3072] [--tokens 1,4,16,32,64,128,256]
                                       [--tune-dir DIR | --no-tune]

The shape defaults to Qwen3.5-122B-A10B's head (vocab 248320 x hidden 3072). The module's load-time
autotune (patches/src/sparkllm_lm_head_int8.py, tune_tiles) runs first on the quantized weight, as at
server load, and its INFO line and the chosen tile per bucket of token counts are printed. For each
token count it prints the median time of `F.linear` on the BF16 weight, of the Triton kernel with the
fixed table's tile (measured on an H200) and with the autotuned tile (what `int8_logits` launches),
their ratios, and the kernel's max abs error against the dequantized weight. Only torch and Triton are
needed: when vLLM is not importable, the two names the module imports from it are given minimal local
definitions (this is a kernel timing, not a serving test). Exit 0 done, 1 the kernel disagreed,
2 usage (bad arguments, no CUDA GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import sys
import types
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "patches" / "src" / "sparkllm_lm_head_int8.py"


def load_module():
    try:
        import vllm.logger  # noqa: F401
        import vllm.model_executor.layers.quantization.base_config  # noqa: F401
    except ImportError:
        import logging

        quant = "vllm.model_executor.layers.quantization"
        names = ["vllm", "vllm.logger", "vllm.model_executor", "vllm.model_executor.layers", quant,
                 f"{quant}.base_config"]
        for name in names:
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["vllm.logger"].init_logger = logging.getLogger
        sys.modules["vllm.model_executor.layers.quantization.base_config"].QuantizeMethodBase = object
    spec = importlib.util.spec_from_file_location("sparkllm_lm_head_int8", SOURCE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def median_ms(fn, reps: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=248320)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--tokens", default="1,4,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tune-dir", default=None,
                    help="cache the autotuned tiles here (SPARKLLM_LM_HEAD_INT8_TUNE_DIR); "
                         "default: not cached")
    ap.add_argument("--no-tune", action="store_true",
                    help="SPARKLLM_LM_HEAD_INT8_TUNE=0: the fixed table in both kernel columns")
    a = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",") if t]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        print(f"--tokens {a.tokens!r}: give a comma-separated list of positive integers", file=sys.stderr)
        return 2
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark times a CUDA kernel", file=sys.stderr)
        return 2
    mod = load_module()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.pop(mod.TUNE_DIR_ENV, None)
    if a.tune_dir:
        os.environ[mod.TUNE_DIR_ENV] = a.tune_dir
    os.environ[mod.TUNE_ENV] = "0" if a.no_tune else "1"
    torch.manual_seed(0)
    w = (torch.randn(a.rows, a.cols, device="cuda") * 0.02).to(torch.bfloat16)
    q, scale, _, _ = mod.quantize_per_row(w)
    deq = (q.float() * scale[:, None]).to(torch.bfloat16)
    gpu = torch.cuda.get_device_name()
    print(f"LM HEAD KERNEL: {gpu}, torch {torch.__version__}, head {a.rows}x{a.cols}, "
          f"BF16 {w.numel() * 2 / 2**20:.0f} MiB -> INT8 {(q.numel() + scale.numel() * 4) / 2**20:.0f} MiB")
    mod.tune_tiles(q, scale, torch.bfloat16)  # logs its one INFO line (tiles, autotuned in X s / from cache)
    print("bucket  fixed_tile              tuned_tile")
    for b in mod.TUNE_BUCKETS:
        tuned = mod.tile_for(b, a.rows, a.cols, torch.bfloat16, q.device)
        print(f"{b:6d}  {str(mod.fixed_tile(b)):22s}  {tuned}")
    print("tokens  bf16_us  fixed_us  tuned_us  fixed/bf16  tuned/bf16  tuned/fixed  tuned_tile  max_abs_err")
    bad = False
    for n in tokens:
        x = torch.randn(n, a.cols, device="cuda").to(torch.bfloat16)
        fixed = mod.fixed_tile(n)
        ref = F.linear(x, deq).float()
        tol = 0.02 * float(ref.abs().max())
        err = max(float((mod.int8_logits(x, q, scale, "triton").float() - ref).abs().max()),
                  float((mod._triton_logits(x, q, scale, fixed).float() - ref).abs().max()))
        bad |= err > tol
        t_bf16 = median_ms(lambda x=x: F.linear(x, w), a.reps, 10)
        t_fixed = median_ms(lambda x=x, t=fixed: mod._triton_logits(x, q, scale, t), a.reps, 10)
        t_tuned = median_ms(lambda x=x: mod.int8_logits(x, q, scale, "triton"), a.reps, 10)
        tile = mod.tile_for(n, a.rows, a.cols, torch.bfloat16, q.device)
        print(f"{n:6d}  {t_bf16 * 1e3:7.0f}  {t_fixed * 1e3:8.0f}  {t_tuned * 1e3:8.0f}  "
              f"{t_fixed / t_bf16:10.2f}  {t_tuned / t_bf16:10.2f}  {t_tuned / t_fixed:11.2f}  {tile}  "
              f"{err:.4g}"
              + ("  (over 2 % of max |logit|)" if err > tol else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
