"""Run vLLM's INC (AutoRound) quantization config on a checkpoint and report its method choices.

Executed in a subprocess by test_inc_hybrid_patch_contract.py, with the Python of .venv-vllm::

    python inc_probe.py CHECKPOINT_DIR [CHECKPOINT_DIR ...] [--vllm-parent DIR]

``--vllm-parent`` is a directory holding a (patched) copy of the ``vllm`` package; it is put first
on sys.path so that copy is imported instead of the installed one. Prints one JSON object with a
result per checkpoint (one process for several checkpoints: importing vLLM takes ~30 s here).

What it does, all with vLLM's own code on the CPU platform:
- a one-process gloo group (init_distributed_environment + initialize_model_parallel(1, 1)),
- INCConfig from the checkpoint's config.json quantization_config, then maybe_update_config(dir)
  as VllmConfig does, then the model's hf_to_vllm_mapper and packed_modules_mapping as
  vLLM's model construction applies them,
- builds the shared expert's fused gate_up_proj / down_proj as real vLLM linear layers with that
  quant config (method chosen and weights created by vLLM), and asks the INC config's GPU-path
  selection about INT4 layers (an attention projection and an expert projection as linear
  layers): on the CPU platform INC's get_quant_method goes to an IPEX path that 0.19.1 does not
  implement, so the CUDA branch (apply_gptq_quant_layer) is called directly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--vllm-parent", default=None)
    a = ap.parse_args()
    if a.vllm_parent:
        sys.path.insert(0, a.vllm_parent)

    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()

    import torch
    import vllm
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.quantization import inc as inc_module

    report: dict[str, object] = {"vllm_file": vllm.__file__, "inc_file": inc_module.__file__}
    torch.set_default_dtype(torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        store = tempfile.mkdtemp(prefix="inc-probe-gloo-")
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"file://{store}/store", backend="gloo",
        )
        initialize_model_parallel(1, 1)
        report["results"] = [
probe_checkpoint(path) for path in a.checkpoints
        ]
    print("INC_PROBE_RESULT " + json.dumps(report, sort_keys=True))
    return 0


def probe_checkpoint(path: str) -> dict[str, object]:
    """Method choices of vLLM's INC config for one checkpoint (needs the process group set up)."""
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.quantization.inc import INCConfig
    from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration as model_cls

    result: dict[str, object] = {"checkpoint": path}
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    text = hf_config["text_config"]
    hidden, shared_inter = text["hidden_size"], text["shared_expert_intermediate_size"]

    config = INCConfig.from_config(hf_config["quantization_config"])
    # What VllmConfig._get_quantization_config does after building the config:
    config.maybe_update_config(path)
    # What model construction does (configure_quant_config / SupportsQuant):
    if getattr(model_cls, "hf_to_vllm_mapper", None) is not None:
        config.apply_vllm_mapper(model_cls.hf_to_vllm_mapper)
    config.packed_modules_mapping = dict(model_cls.packed_modules_mapping)

    fp8_layers = sorted(getattr(config, "fp8_layers", set()))
    result["fp8_layer_count"] = len({n for n in fp8_layers if n.startswith("model.language_model.")})
    fp8_config = getattr(config, "fp8_config", None)
    result["fp8_block"] = getattr(fp8_config, "weight_block_size", None)
    result["fp8_dynamic"] = getattr(fp8_config, "activation_scheme", None) == "dynamic"

    def layer_report(layer) -> dict[str, object]:
        params = {n: [str(p.dtype), list(p.shape)] for n, p in layer.named_parameters()}
        return {"method": type(layer.quant_method).__name__, "params": params}

    prefix = "language_model.model.layers.0"
    # Shared expert: built exactly as Qwen2MoeMLP builds it (fused gate_up_proj + down_proj).
    gate_up = MergedColumnParallelLinear(
        hidden, [shared_inter] * 2, bias=False, quant_config=config,
        prefix=f"{prefix}.mlp.shared_expert.gate_up_proj",
    )
    down = RowParallelLinear(
        shared_inter, hidden, bias=False, quant_config=config,
        prefix=f"{prefix}.mlp.shared_expert.down_proj",
    )
    result["shared_gate_up"] = layer_report(gate_up)
    result["shared_down"] = layer_report(down)

    # INT4 layers: the CPU platform sends INC to its IPEX path (NotImplementedError in 0.19.1),
    # so select with the GPU path, as get_quant_method does on CUDA.
    heads, kv_heads, head_dim = 4, 2, 16
    qkv = QKVParallelLinear(hidden, head_dim, 2 * heads, kv_heads, bias=False, quant_config=None,
                            prefix=f"{prefix}.self_attn.qkv_proj")
    int4_prefix = "language_model.model.layers.3.self_attn.qkv_proj"
    result["int4_attention_method"] = type(config.apply_gptq_quant_layer(qkv, int4_prefix)).__name__
    fp8_first = getattr(config, "get_fp8_quant_method", None)
    result["int4_attention_fp8_route"] = type(fp8_first(qkv, int4_prefix)).__name__ if fp8_first else None
    expert_prefix = f"{prefix}.mlp.experts.0.gate_proj"
    expert = RowParallelLinear(text["moe_intermediate_size"], hidden, bias=False, quant_config=None,
                               prefix=expert_prefix)
    result["int4_expert_linear_method"] = type(config.apply_gptq_quant_layer(expert, expert_prefix)).__name__
    result["int4_expert_fp8_route"] = type(fp8_first(expert, expert_prefix)).__name__ if fp8_first else None
    # Router and shared-expert gate stay 16-bit in both versions.
    gate = RowParallelLinear(hidden, 1, bias=False, quant_config=None,
                             prefix=f"{prefix}.mlp.shared_expert_gate")
    result["shared_expert_gate_method"] = type(
        config.get_quant_method(gate, f"{prefix}.mlp.shared_expert_gate")).__name__
    return result


if __name__ == "__main__":
    sys.exit(main())
