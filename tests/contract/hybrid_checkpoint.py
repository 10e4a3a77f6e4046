"""Tiny hybrid INT4 + FP8 Qwen3.5 checkpoints for the INC patch contract test.

Built from the tensor specs of tests/fixtures/make_checkpoints.py (the project's checkpoint
generator, real Qwen3.5-122B-A10B names): every layer as in the AutoRound INT4 checkpoint, except
the shared-expert gate/up/down projections, which are F8_E4M3 weights with ``weight_scale_inv``
block scales, as the hybrid merge produces. The quantization config is AutoRound's, with the
layers AutoRound kept at 16 bits listed in ``extra_config`` (shared expert, its gate, the router).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tests.fixtures import make_checkpoints as mc


@dataclass(frozen=True)
class Hybrid:
    path: Path
    block: int
    fp8_layers: list[str]  # checkpoint names of the FP8 layers (without ".weight")
    shapes: dict[str, list[int]]  # tensor name -> shape


def sixteen_bit_layers(c: mc.GenConfig) -> list[str]:
    names = []
    for i in range(c.layers):
        p = f"{mc.LM}.layers.{i}.mlp"
        names += [f"{p}.shared_expert.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
        names += [f"{p}.shared_expert_gate", f"{p}.gate"]
    return names


def write_hybrid(out: Path, block: int = 128, fp8_shared: bool = True, layers: int = 4) -> Hybrid:
    """Write a hybrid checkpoint to ``out``. fp8_shared=False writes the plain INT4 layout."""
    c = replace(mc.GenConfig(), layers=layers, experts=4, hidden=256, moe_inter=64, shared_inter=128,
                block=block, int4_shards=2)
    shared_lin = mc.fp8 if fp8_shared else mc.bf16
    tensors = mc.top_and_visual(c)[:2]
    for i in range(c.layers):
        tensors += mc.layer(i, c, mc.gptq, mc.gptq, shared_lin)
    tensors += mc.top_and_visual(c)[2:]
    out.mkdir(parents=True, exist_ok=True)
    pool = mc.BytePool(c.seed)
    weight_map = mc.write_sharded(out, tensors, c.int4_shards, pool)
    mc.write_index(out, weight_map, {t.name: t.nbytes for t in tensors})
    quant = {
        "quant_method": "auto-round",
        "bits": 4,
        "group_size": c.group_size,
        "sym": True,
        "packing_format": "auto_round:auto_gptq",
        "extra_config": {name: {"bits": 16, "data_type": "fp"} for name in sixteen_bit_layers(c)},
    }
    mc.write_side_files(out, c, quant, "spark-llm-toolkit/contract-hybrid")
    # Also the MTP extra file that is NOT in the index (vLLM must not read it; neither does the patch).
    mc.write_safetensors(out / "model_extra_tensors.safetensors", mc.mtp_tensors(c, mc.bf16), pool)
    fp8_layers = sorted(t.name[: -len(".weight")] for t in tensors
                        if t.dtype == "F8_E4M3" and t.name.endswith(".weight"))
    return Hybrid(out, block, fp8_layers, {t.name: list(t.shape) for t in tensors})


def read_quant_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]
