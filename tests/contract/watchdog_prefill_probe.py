"""Runs one vLLM release's own KV-cache and metrics code through a chunked prefill (run by
tests/contract/test_watchdog_contract.py with the release first on PYTHONPATH; prints one JSON line).

A prompt of PROMPT tokens is scheduled in chunks of CHUNK tokens as the scheduler does: each step
``KVCacheManager.allocate_slots`` takes the chunk's blocks and the step's stats are what
``Scheduler.make_stats`` builds (num_running_reqs, kv_cache_usage = the manager's usage, the prefix-cache
stats it drains); a step without a request output gets no IterationStats (``AsyncLLM``'s output handler:
``IterationStats() if (log_stats and num_outputs) else None``, which the test checks in the source) and both
go to the release's own ``PrometheusStatLogger.record``. The exposition text after each step is printed.
Arguments: BLOCK:CHUNK pairs (tokens per KV block, tokens per chunk), one prefill each.
"""

from __future__ import annotations

import inspect
import json
import sys
from types import SimpleNamespace

PROMPT = 1000


def _kwargs(fn, **want):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in want.items() if k in params}


def prefill(block_size: int, chunk: int) -> list[str]:
    """The /metrics text before the prompt is scheduled and after each of its chunk steps."""
    import prometheus_client
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.request import Request

    spec = FullAttentionSpec(**_kwargs(FullAttentionSpec, block_size=block_size, num_kv_heads=1,
                                       head_size=8, dtype=torch.float16))
    blocks = 200
    tensor = KVCacheTensor(size=spec.page_size_bytes * blocks, shared_by=["layer.0"])
    cfg = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[tensor],
                        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)])
    manager = KVCacheManager(cfg, **_kwargs(KVCacheManager.__init__, max_model_len=4096, log_stats=True,
                                            hash_block_size=block_size, scheduler_block_size=block_size,
                                            enable_caching=True))
    init_none_hash(sha256)
    req = Request(request_id="r", prompt_token_ids=list(range(PROMPT)),
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  block_hasher=get_request_block_hasher(block_size, sha256))
    observability = SimpleNamespace(show_hidden_metrics=False, kv_cache_metrics=False,
                                    cudagraph_metrics=False, enable_mfu_metrics=False)
    model = SimpleNamespace(served_model_name="m", max_model_len=4096, is_diffusion=False)
    vllm_config = SimpleNamespace(observability_config=observability, speculative_config=None,
                                  lora_config=None, kv_transfer_config=None, model_config=model,
                                  cache_config=SimpleNamespace(num_gpu_blocks=blocks),
                                  parallel_config=SimpleNamespace(data_parallel_size=1))
    logger = PrometheusStatLogger(vllm_config, [0])  # type: ignore[arg-type]
    texts = [prometheus_client.generate_latest().decode()]
    # first scheduled: the prefix-cache lookup (Scheduler.schedule -> get_computed_blocks), then one
    # allocate_slots per chunk step; no step emits an output until the whole prompt is computed
    manager.get_computed_blocks(req)
    while req.num_computed_tokens < PROMPT - 1:  # the last chunk's step would emit the first token
        n = min(chunk, PROMPT - 1 - req.num_computed_tokens)
        assert manager.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=manager.usage,
                               prefix_cache_stats=manager.make_prefix_cache_stats())
        logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
        texts.append(prometheus_client.generate_latest().decode())
    return texts


def main() -> int:
    import vllm

    runs = {pair: prefill(*(int(x) for x in pair.split(":"))) for pair in sys.argv[1:]}
    print("PREFILL " + json.dumps({"version": vllm.__version__, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
