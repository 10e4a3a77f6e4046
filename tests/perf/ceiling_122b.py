#!/usr/bin/env python3
"""The physical decode ceiling of the served Qwen3.5-122B-A10B hybrid, from its published shapes.

No checkpoint needed: the served hybrid's tensor inventory is rebuilt at its real shapes (names and
layout as tests/fixtures/make_checkpoints.py and docs/model.md describe them: Intel's INT4 AutoRound
checkpoint in GPTQ packing, group size 128, for the routed experts and the attention and linear-attention
projections; the shared experts FP8 with 128 x 128 block scales; router, norms, embedding and LM head
BF16) and handed to ``sparkllm.bench.ceiling.breakdown``, the code ``bench.py run --model-dir`` uses on
the real headers. On a Spark, ``scripts/bench.py ceiling --model-dir /srv/models/qwen3.5-122b-hybrid``
gives the figure from the checkpoint itself.

Shapes (Qwen3.5-122B-A10B text config): hidden 3072, 48 layers, every 4th full attention (32 query heads
with an output gate, 2 KV heads, head dim 256), the others Gated DeltaNet (16 key heads, 64 value heads,
head dims 128, conv kernel 4, ``mamba_ssm_dtype`` float32), 256 routed experts (top 8, intermediate 1024)
plus one shared expert (intermediate 1024), vocabulary 248320, one MTP layer. Sources: the Hugging Face
transformers Qwen3.5-MoE documentation (256 experts, 8 routed + 1 shared, 3:1 Gated DeltaNet/attention)
and the model's config.json as public model cards and configs quote it; check them against the real
config with the command above.

    .venv/bin/python tests/perf/ceiling_122b.py [--bandwidth-gbs 273] [--context 0,1024,4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts")]

from sparkllm.bench import ceiling as bc  # noqa: E402
from sparkllm.checkpoint.safetensors_io import DTYPE_SIZES, TensorInfo  # noqa: E402

H, LAYERS, INTERVAL, VOCAB = 3072, 48, 4, 248320
HEADS, KV_HEADS, HEAD_DIM = 32, 2, 256
LK, LV, LDK, LDV, KERNEL = 16, 64, 128, 128, 4
EXPERTS, TOP_K, MOE, SHARED = 256, 8, 1024, 1024
GROUP, BLOCK = 128, 128
LM = "model.language_model"
CONFIG = {"hidden_size": H, "num_hidden_layers": LAYERS, "full_attention_interval": INTERVAL,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "linear_num_key_heads": LK, "linear_num_value_heads": LV, "linear_key_head_dim": LDK,
          "linear_value_head_dim": LDV, "linear_conv_kernel_dim": KERNEL, "mamba_ssm_dtype": "float32",
          "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": MOE,
          "shared_expert_intermediate_size": SHARED, "vocab_size": VOCAB, "torch_dtype": "bfloat16"}


def t(name: str, dtype: str, *shape: int) -> TensorInfo:
    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= d
    return TensorInfo(name, dtype, tuple(shape), 0, n)


def int4(base: str, out: int, inp: int) -> list[TensorInfo]:
    return [t(f"{base}.qweight", "I32", inp // 8, out), t(f"{base}.qzeros", "I32", inp // GROUP, out // 8),
            t(f"{base}.scales", "F16", inp // GROUP, out)]


def fp8(base: str, out: int, inp: int) -> list[TensorInfo]:
    return [t(f"{base}.weight", "F8_E4M3", out, inp),
            t(f"{base}.weight_scale_inv", "F32", -(-out // BLOCK), -(-inp // BLOCK))]


def bf16(base: str, out: int, inp: int) -> list[TensorInfo]:
    return [t(f"{base}.weight", "BF16", out, inp)]


def layer(p: str, full: bool, lin=int4, experts=int4, shared=fp8) -> list[TensorInfo]:
    out = [t(f"{p}.input_layernorm.weight", "BF16", H), t(f"{p}.post_attention_layernorm.weight", "BF16", H)]
    if full:
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        out += [*lin(f"{p}.self_attn.q_proj", 2 * q, H), *lin(f"{p}.self_attn.k_proj", kv, H),
                *lin(f"{p}.self_attn.v_proj", kv, H), *lin(f"{p}.self_attn.o_proj", H, q),
                t(f"{p}.self_attn.q_norm.weight", "BF16", HEAD_DIM),
                t(f"{p}.self_attn.k_norm.weight", "BF16", HEAD_DIM)]
    else:
        conv = 2 * LK * LDK + LV * LDV
        out += [*lin(f"{p}.linear_attn.in_proj_qkv", conv, H),
                *lin(f"{p}.linear_attn.in_proj_z", LV * LDV, H),
                t(f"{p}.linear_attn.in_proj_b.weight", "BF16", LV, H),
                t(f"{p}.linear_attn.in_proj_a.weight", "BF16", LV, H),
                t(f"{p}.linear_attn.conv1d.weight", "BF16", conv, 1, KERNEL),
                t(f"{p}.linear_attn.dt_bias", "BF16", LV), t(f"{p}.linear_attn.A_log", "F32", LV),
                t(f"{p}.linear_attn.norm.weight", "F32", LDV),
                *lin(f"{p}.linear_attn.out_proj", H, LV * LDV)]
    out += [t(f"{p}.mlp.gate.weight", "BF16", EXPERTS, H),
            t(f"{p}.mlp.shared_expert_gate.weight", "BF16", 1, H)]
    for proj, o, i in (("gate_proj", SHARED, H), ("up_proj", SHARED, H), ("down_proj", H, SHARED)):
        out += shared(f"{p}.mlp.shared_expert.{proj}", o, i)
    for e in range(EXPERTS):
        for proj, o, i in (("gate_proj", MOE, H), ("up_proj", MOE, H), ("down_proj", H, MOE)):
            out += experts(f"{p}.mlp.experts.{e}.{proj}", o, i)
    return out


def inventory() -> list[TensorInfo]:
    out = [t(f"{LM}.embed_tokens.weight", "BF16", VOCAB, H), t(f"{LM}.norm.weight", "BF16", H),
           t("lm_head.weight", "BF16", VOCAB, H)]
    for i in range(LAYERS):
        out += layer(f"{LM}.layers.{i}", (i + 1) % INTERVAL == 0)
    out += [t("mtp.fc.weight", "BF16", H, 2 * H), t("mtp.norm.weight", "BF16", H)]
    return out + layer("mtp.layers.0", True, bf16, bf16, bf16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth-gbs", type=float, default=bc.GB10_BANDWIDTH_GBS,
                    help="memory bandwidth in GB/s (default: %(default)s)")
    ap.add_argument("--context", default="0,1024,4096",
                    help="context tokens, comma separated (default: %(default)s)")
    a = ap.parse_args(argv)
    tensors = inventory()
    for int8 in (False, True):
        base = bc.breakdown(CONFIG, tensors, lm_head_int8=int8, bandwidth_gbs=a.bandwidth_gbs)
        print(f"== LM head {'INT8' if int8 else 'BF16'}")
        print("\n".join(bc.breakdown_lines(base)))
        for c in (int(x) for x in a.context.split(",") if x.strip()):
            d = bc.with_context(base, c)
            print(f"context {c:>6}: {d['bytes_per_token'] / 1e9:.3f} GB/token -> ceiling "
                  f"{d['ceiling_tok_s']:.1f} tok/s")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
