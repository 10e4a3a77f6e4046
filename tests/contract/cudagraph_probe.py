"""CUDA-graph capture sizes as this vLLM computes them (run in a subprocess; vLLM from sys.path).

Calls the release's own ``VllmConfig._set_cudagraph_sizes`` (0.19.1: vllm/config/vllm.py:1343-1470;
0.26.0: vllm/config/vllm.py:1739-) on a stand-in ``self`` that carries only the fields it reads (no
model, no GPU), then, for speculative decoding, the release's own
``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`` (0.19.1 vllm/config/compilation.py:1238,
0.26.0 :1503), which the GPU model runner applies for FULL decode graphs (0.19.1
v1/worker/gpu_model_runner.py:6380-6392). stdin: JSON list of {"max_num_seqs", "k",
"max_num_batched_tokens"}; stdout: one line CUDAGRAPH_PROBE_RESULT <json list>.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import vllm
from vllm.config.compilation import CompilationConfig
from vllm.config.vllm import VllmConfig


def sizes(max_num_seqs: int, k: int, max_num_batched_tokens: int) -> dict:
    cc = CompilationConfig()
    fake = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False), compilation_config=cc,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens),
        speculative_config=SimpleNamespace(num_speculative_tokens=k) if k else None, num_speculative_tokens=k,
        performance_mode="balanced", parallel_config=SimpleNamespace(tensor_parallel_size=1),
        update_sizes_for_sequence_parallelism=lambda s: s)
    VllmConfig._set_cudagraph_sizes(fake)
    base = list(cc.cudagraph_capture_sizes)
    if k:
        cc.adjust_cudagraph_sizes_for_spec_decode(k + 1, 1)
    return {"version": vllm.__version__, "sizes": base, "full_decode_sizes": list(cc.cudagraph_capture_sizes),
            "max": cc.max_cudagraph_capture_size}


def main() -> int:
    reqs = json.loads(sys.stdin.read())
    answers = [sizes(r["max_num_seqs"], r["k"], r["max_num_batched_tokens"]) for r in reqs]
    print("CUDAGRAPH_PROBE_RESULT " + json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
