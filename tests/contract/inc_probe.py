"""Run vLLM's INC (AutoRound) quantization config on a checkpoint and report its method choices.

Executed in a subprocess by the INC patch contract tests, with the Python of .venv-vllm::

    python inc_probe.py CHECKPOINT_DIR [CHECKPOINT_DIR ...] [--vllm-parent DIR]

``--vllm-parent`` is a directory holding a (patched) copy of the ``vllm`` package; it is put first
on sys.path so that copy is imported instead of the installed one (for vLLM 0.20.0: a copy of the
pure-Python part of its wheel; 0.19.1's compiled extensions are not on that path, so vLLM runs
without ``vllm._C``, which nothing below needs). Prints one JSON object with a result per
checkpoint (one process for several checkpoints: importing vLLM takes ~30 s here).

What it does, all with vLLM's own code on the CPU platform:
- a one-process gloo group (init_distributed_environment + initialize_model_parallel(1, 1)),
- per checkpoint a real ModelConfig (config.json read by vLLM, dtype bfloat16) and VllmConfig:
  VllmConfig builds the INC config itself (get_quant_config, then maybe_update_config called the
  way that vLLM version calls it), then the model's hf_to_vllm_mapper and packed_modules_mapping
  are applied as vLLM's model construction applies them,
- builds the shared expert's fused gate_up_proj / down_proj as real vLLM linear layers with that
  quant config (method chosen and weights created by vLLM), then loads the checkpoint's shared
  expert tensors into them with the parameters' own weight_loader, after the model's
  hf_to_vllm_mapper and the stacked-parameter renaming Qwen3_5Model.load_weights does
  (gate_proj/up_proj -> gate_up_proj shards 0/1, copied here): a tensor with no parameter of
  that name is what the loader would skip ("not found in params_dict"),
- asks the INC config about INT4 layers (an attention projection and an expert projection as
  linear layers) with the GPU path (apply_gptq_quant_layer): on the CPU platform 0.19.1's
  get_quant_method goes to an IPEX path it does not implement (0.20.0's CPU path ends in the same
  apply_gptq_quant_layer).

Not exercised: any GEMM or kernel. vLLM 0.20.0 picks the FP8 GEMM kernel inside
Fp8LinearMethod.create_weights (init_fp8_linear_kernel) and has no FP8 block kernel for the CPU
platform. The probe wraps that function: it calls the real one, records its arguments (the
weight/activation quant group shapes, the weight shape) and, only when the real call raises,
records the error and hands back an inert placeholder so that create_weights can finish. Which
parameters create_weights registers (the subject here) happens before that call and is unchanged.
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
    from vllm.model_executor.layers.quantization.inc import INCConfig

    # the file INCConfig is defined in: quantization/inc.py (0.19.1, 0.20.0), inc/inc.py (0.26.0)
    report: dict[str, object] = {"vllm_file": vllm.__file__,
                                 "inc_file": sys.modules[INCConfig.__module__].__file__,
                                 "vllm_version": vllm.__version__}
    kernel_calls = record_fp8_kernel_choice()
    torch.set_default_dtype(torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        store = tempfile.mkdtemp(prefix="inc-probe-gloo-")
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"file://{store}/store", backend="gloo",
        )
        initialize_model_parallel(1, 1)
        results = []
        for path in a.checkpoints:
            kernel_calls.clear()
            result = probe_checkpoint(path)
            result["fp8_kernel_calls"] = list(kernel_calls)
            results.append(result)
        report["results"] = results
    print("INC_PROBE_RESULT " + json.dumps(report, sort_keys=True))
    return 0


class _NoFp8KernelOnThisPlatform:
    """Stands in for the FP8 GEMM kernel where vLLM has none for the platform (never applied)."""


def record_fp8_kernel_choice() -> list[dict[str, object]]:
    """Wrap fp8.init_fp8_linear_kernel (0.20.0: called by create_weights) to record its inputs."""
    from vllm.model_executor.layers.quantization import fp8 as fp8_module

    calls: list[dict[str, object]] = []
    real = getattr(fp8_module, "init_fp8_linear_kernel", None)
    if real is None:
        return calls

    def group(key) -> list[int] | None:
        shape = getattr(getattr(key, "scale", None), "group_shape", None)
        return None if shape is None else [int(x) for x in shape]

    def recording(*args, **kwargs):
        entry: dict[str, object] = {
            "weight_group": group(kwargs.get("weight_quant_key")),
            "activation_group": group(kwargs.get("activation_quant_key")),
            "weight_shape": list(kwargs["weight_shape"]) if "weight_shape" in kwargs else None,
        }
        calls.append(entry)
        try:
            kernel = real(*args, **kwargs)
        except Exception as e:  # no FP8 kernel for the CPU platform (0.20.0)
            entry["kernel_error"] = f"{type(e).__name__}: {e}"
            return _NoFp8KernelOnThisPlatform()
        entry["kernel"] = type(kernel).__name__
        return kernel

    fp8_module.init_fp8_linear_kernel = recording
    return calls


# Qwen3_5Model.load_weights' stacked_params_mapping entries for the MLP (checkpoint part -> fused
# parameter, shard id); every other shared-expert tensor is loaded under its own name.
STACKED_MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_shared_expert(path: str, model_cls, layers: dict[str, object], vllm_prefix: str
                       ) -> dict[str, object]:
    """Load the checkpoint's shared-expert tensors of layer 0 into ``layers`` as vLLM would."""
    import torch
    from safetensors import safe_open

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    hf_prefix = "model.language_model.layers.0.mlp.shared_expert."
    names = sorted(n for n in weight_map if n.startswith(hf_prefix))
    report: dict[str, object] = {"checkpoint_tensors": names, "loaded": [], "not_found": [],
                                 "errors": {}, "mismatched": []}
    for name in names:
        with safe_open(os.path.join(path, weight_map[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
        mapped = next(iter(mapper.apply([(name, tensor)])))[0] if mapper is not None else name
        assert mapped.startswith(vllm_prefix), (mapped, vllm_prefix)
        part, _, param_name = mapped[len(vllm_prefix):].partition(".")
        layer_name, shard = STACKED_MLP.get(part, (part, None))
        params = dict(layers[layer_name].named_parameters()) if layer_name in layers else {}
        if param_name not in params:
            report["not_found"].append(f"{vllm_prefix}{layer_name}.{param_name}")
            continue
        param = params[param_name]
        try:
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
        except Exception as e:
            report["errors"][name] = f"{type(e).__name__}: {e}"
            continue
        report["loaded"].append(name)
        rows = tensor.shape[0]
        start = 0 if shard in (None, 0) else param.shape[0] - rows
        got = param.data[start:start + rows].contiguous()
        # compare bytes: the generated weights are random bit patterns (NaNs compare unequal)
        same = got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8),
                                                         tensor.contiguous().view(torch.uint8))
        if not same:
            report["mismatched"].append(name)
    return report


def probe_checkpoint(path: str) -> dict[str, object]:
    """Method choices of vLLM's INC config for one checkpoint (needs the process group set up)."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    # vLLM's own ModelConfig/VllmConfig: VllmConfig builds the quant config and calls
    # maybe_update_config the way this vLLM version does. 0.20.0's Fp8LinearMethod reads the
    # model dtype from the current VllmConfig.
    vllm_config = VllmConfig(model_config=ModelConfig(model=path, dtype="bfloat16"))
    with set_current_vllm_config(vllm_config):
        return probe_with_config(path, vllm_config.quant_config)


def probe_with_config(path: str, config) -> dict[str, object]:
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

    assert isinstance(config, INCConfig), type(config)
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
    result["shared_load"] = load_shared_expert(
        path, model_cls, {"gate_up_proj": gate_up, "down_proj": down},
        f"{prefix}.mlp.shared_expert.")

    # INT4 layers: the CPU platform sends INC to its IPEX path (NotImplementedError in 0.19.1),
    # so select with the GPU path, as get_quant_method does on CUDA.
    heads, kv_heads, head_dim = 4, 2, 16
    qkv = QKVParallelLinear(hidden, head_dim, 2 * heads, kv_heads, bias=False, quant_config=None,
                            prefix=f"{prefix}.self_attn.qkv_proj")
    int4_prefix = "language_model.model.layers.3.self_attn.qkv_proj"
    result["int4_attention_method"] = int4_linear_method(config, qkv, int4_prefix)
    fp8_first = getattr(config, "get_fp8_quant_method", None)
    result["int4_attention_fp8_route"] = type(fp8_first(qkv, int4_prefix)).__name__ if fp8_first else None
    expert_prefix = f"{prefix}.mlp.experts.0.gate_proj"
    expert = RowParallelLinear(text["moe_intermediate_size"], hidden, bias=False, quant_config=None,
                               prefix=expert_prefix)
    result["int4_expert_linear_method"] = int4_linear_method(config, expert, expert_prefix)
    result["int4_expert_fp8_route"] = type(fp8_first(expert, expert_prefix)).__name__ if fp8_first else None
    # Router and shared-expert gate stay 16-bit in both versions.
    gate = RowParallelLinear(hidden, 1, bias=False, quant_config=None,
                             prefix=f"{prefix}.mlp.shared_expert_gate")
    result["shared_expert_gate_method"] = type(
        config.get_quant_method(gate, f"{prefix}.mlp.shared_expert_gate")).__name__
    return result


def method_name(method) -> str:
    """Class name of a linear method; 0.26.0's INC wrapper as ``INCLinearMethod(<inner>)``."""
    inner = getattr(getattr(method, "scheme", None), "inner_method", None)
    name = type(method).__name__
    return f"{name}({type(inner).__name__})" if inner is not None else name


def int4_linear_method(config, layer, prefix: str) -> str:
    """The method INC picks for an INT4 linear layer on CUDA.

    0.19.1/0.20.0: apply_gptq_quant_layer (what get_quant_method calls on CUDA). 0.26.0 has no
    such method: its own get_quant_method (config parser, then the scheme factory) runs as it is.
    On the CPU platform (no auto_round_kernel installed) its WNA16 scheme falls back to the same
    INCLinearMethod(INCWNA16LinearScheme) its CUDA branch returns, and that scheme builds the
    GPTQ-Marlin method (AutoGPTQLinearMethod) when Marlin supports the type and group size.
    """
    legacy = getattr(config, "apply_gptq_quant_layer", None)
    if legacy is not None:
        return method_name(legacy(layer, prefix))
    return method_name(config.get_quant_method(layer, prefix))


if __name__ == "__main__":
    sys.exit(main())
