#!/usr/bin/env python3
"""A tiny Qwen3.5-122B-A10B look-alike in the two published formats, for the real-GPU run.

    python3 tests/gpu/tiny_pair.py OUT [--seed N]

writes OUT/int4 (as Intel's AutoRound INT4 release is laid out) and OUT/fp8 (as Qwen's FP8
release), both from one set of BF16 "source" weights, in a few seconds (numpy only, no torch).

Architecture (what vLLM's Qwen3_5MoeForConditionalGeneration and Qwen3_5MoeMTP load):
hidden 256; 4 decoder layers, DeltaNet ``linear_attn`` in layers 0-2 and a gated full-attention
``self_attn`` in layer 3 (every 4th); 8 routed experts (top 2) + ``shared_expert`` +
``shared_expert_gate`` per layer; one ``mtp.*`` layer; a one-block ``model.visual`` tower (the
config needs a vision part; the GPU run passes ``--language-model-only``). Dimensions are those the
kernels accept: INT4 group 128 (GPTQ-Marlin), FP8 blocks 128x128.

Formats:
* int4/: routed experts (per expert) and the attention/DeltaNet projections GPTQ-packed, symmetric
  4 bit, group 128 (``qweight`` I32 [in/8, out], ``qzeros`` I32 [in/128, out/8] all nibbles 7,
  ``scales`` F16 [in/128, out]); shared experts, their gate, the router, ``in_proj_a/b`` (out = 4,
  not packable), norms, embeddings, ``lm_head`` and vision in BF16; ``mtp.*`` in BF16 in
  ``model_extra_tensors.safetensors``, **not** in the index; AutoRound's quantization_config
  (quant_method auto-round, packing auto_round:auto_gptq, block_name_to_quantize, extra_config
  listing the 16-bit layers).
* fp8/: F8_E4M3 ``weight`` + F32 ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] for the
  attention/DeltaNet projections, shared experts and routed experts of the trunk and of ``mtp.*``;
  everything else BF16; Qwen's quantization_config (fp8, e4m3, dynamic, block [128, 128],
  modules_to_not_convert); ``mtp.*`` listed in the index.

Weights are built so that speculation can be checked, not only run: the model is a
"successor machine". Every printable ASCII byte token t has a fixed successor S(t) (one cycle
through all 95 of them); any other token maps to some printable one. The embedding rows are
random, ``lm_head`` row j is the sum of the unit embeddings of the tokens whose successor is j
(scaled by ``LOGIT_SCALE``), every other matrix is small noise (std 0.02), so each layer adds a
small, input-dependent perturbation to the residual stream and greedy decoding follows S. The MTP
head's ``fc`` passes the (normed) embedding of the token it is given and ignores the hidden state,
so its draft is S(next token): the same token the trunk will produce, and acceptance is near 1.
Greedy text therefore depends on the prompt's last token, and completions longer than 95 tokens
repeat (which n-gram drafting can exploit).

The tokenizer is byte-level BPE with no merges (256 byte tokens + Qwen's special tokens), written
as tokenizer.json directly: deterministic, no training, no download.

``--hidden 3072 --head-rows 248320`` gives the head the real model's shape (tests/gpu/head_records.py):
the layers stay tiny (their fan-in-H noise scaled so they perturb as much as at hidden 256), and the
embedding and lm_head are padded past the tokenizer's ids (see ``head_rows``).

Prints one JSON line: paths, tensor counts, sizes, and the successor map of the printable bytes.
Exit codes: 0 written, 1 the output exists and is not ours, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

# ------------------------------------------------------------------ dimensions
H = 256
LAYERS = 4
FULL_EVERY = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
LK_HEADS, LV_HEADS, LK_DIM, LV_DIM, CONV_K = 2, 4, 64, 64, 4
EXPERTS, TOPK, MOE_I, SHARED_I = 8, 2, 128, 128
MAX_POS = 4096
ROTARY = 0.25  # rotary dim = 16 -> mrope sections sum to 8
MROPE = [3, 3, 2]
VIS = {"depth": 1, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128, "in_channels": 3,
       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
       "num_position_embeddings": 64}
GROUP, BLOCK, FP8_MAX = 128, 128, 448.0
NOISE = 0.02
LOGIT_SCALE = 0.4  # correct-token logit ~ 0.4 * 16 = 6.4 over noise of ~0.7: greedy is stable,
#                    top probability ~0.6, so logprobs carry information
# --shared-experts-matter (Source._make_shared_experts_matter): decoy and answer-code weights of lm_head,
# the last layer's shared-expert lookup (input selectivity, residual write)
DECOY_SCALE, CODE_SCALE, SHARED_SELECT, SHARED_WRITE = 0.5, 0.6, 0.25, 10.0
LM = "model.language_model."
EXTRA_FILE = "model_extra_tensors.safetensors"
MARKER = ".sparkllm_tiny_pair.json"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]  # Qwen's own; vLLM's tool parsers need <tool_call>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PRINTABLE = list(range(32, 127))  # byte token ids of printable ASCII (byte b has id b)
INT4_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj")
SHARED_LINEARS = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                  "mlp.shared_expert.down_proj")


def vocab_size() -> int:
    n = 256 + len(SPECIALS)
    return -(-n // 64) * 64


# --hidden / --head-rows (generate(hidden=, head_rows=)): the real model's head shape on the tiny model
# (tests/gpu/head_records.py). Only the embedding and lm_head grow to head_rows(): the rows past
# vocab_size() are padding (no token of the tokenizer reaches them, as Qwen pads 248077 tokens to
# 248320): zero in the embedding, small fixed noise in lm_head (PAD_LOGIT_STD, so the head is read and
# quantized as a real one is, and never outscores the successor's logit, ~6.4).
DEFAULT_H = H
_HEAD_ROWS: int | None = None
PAD_LOGIT_STD = 0.25  # std of a padding row's logit: row std PAD_LOGIT_STD / sqrt(H) (|normed h| = sqrt(H))
PAD_BLOCK = 4096  # distinct noise rows, repeated to fill the padding (cheap to write)
PADDED = (LM + "embed_tokens.weight", "lm_head.weight")


def head_rows() -> int:
    """config vocab_size: the rows of embed_tokens and lm_head."""
    return _HEAD_ROWS or vocab_size()


def special_id(tok: str) -> int:
    return 256 + SPECIALS.index(tok)


# ------------------------------------------------------------------ tokenizer
def _byte_unicode() -> dict[int, str]:
    """The byte -> printable character table byte-level BPE uses (bytes that print as themselves
    keep their character; the others are shifted above 255)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_tokenizer(d: Path) -> None:
    table = _byte_unicode()
    vocab = {table[b]: b for b in range(256)}
    added = [{"id": special_id(s), "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": not s.startswith(("<tool", "</tool"))}
             for s in SPECIALS]  # like Qwen's: tool tags are not special (they stay in decoded text)
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
    (d / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": MAX_POS,
        "additional_special_tokens": SPECIALS[3:], "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }, indent=1))
    (d / "generation_config.json").write_text(json.dumps({
        "bos_token_id": special_id("<|endoftext|>"),
        "eos_token_id": [special_id("<|im_end|>"), special_id("<|endoftext|>")],
        "pad_token_id": special_id("<|endoftext|>")}, indent=1))


# ------------------------------------------------------------------ config
def layer_types() -> list[str]:
    return ["full_attention" if (i + 1) % FULL_EVERY == 0 else "linear_attention" for i in range(LAYERS)]


def model_config() -> dict:
    text = {
        "model_type": "qwen3_5_moe_text", "hidden_size": H, "num_hidden_layers": LAYERS,
        "layer_types": layer_types(), "full_attention_interval": FULL_EVERY,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "attn_output_gate": True, "attention_bias": False, "attention_dropout": 0.0,
        "linear_num_key_heads": LK_HEADS, "linear_num_value_heads": LV_HEADS,
        "linear_key_head_dim": LK_DIM, "linear_value_head_dim": LV_DIM,
        "linear_conv_kernel_dim": CONV_K, "mamba_ssm_dtype": "float32",
        "num_experts": EXPERTS, "num_experts_per_tok": TOPK, "moe_intermediate_size": MOE_I,
        "shared_expert_intermediate_size": SHARED_I, "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "max_position_embeddings": MAX_POS, "partial_rotary_factor": ROTARY,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "mrope_interleaved": True,
                            "mrope_section": MROPE, "partial_rotary_factor": ROTARY},
        "vocab_size": head_rows(), "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": special_id("<|endoftext|>"), "eos_token_id": special_id("<|im_end|>"),
        "pad_token_id": None, "dtype": "bfloat16",
    }
    vision = dict(VIS, model_type="qwen3_5_moe", hidden_act="gelu_pytorch_tanh", out_hidden_size=H,
                  deepstack_visual_indexes=[], initializer_range=0.02)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "dtype": "bfloat16", "tie_word_embeddings": False, "language_model_only": False,
        "image_token_id": special_id("<|image_pad|>"), "video_token_id": special_id("<|video_pad|>"),
        "vision_start_token_id": special_id("<|vision_start|>"),
        "vision_end_token_id": special_id("<|vision_end|>"),
        "text_config": text, "vision_config": vision,
    }


def int4_quant_config() -> dict:
    """AutoRound's config as Intel publishes it for this model: 4 bit, group 128, symmetric, GPTQ
    packing, the decoder blocks quantized, the layers kept at 16 bits listed in extra_config."""
    extra = {}
    for i, kind in enumerate(layer_types()):
        p = f"{LM}layers.{i}."
        for m in (*SHARED_LINEARS, "mlp.shared_expert_gate"):
            extra[p + m] = {"bits": 16, "data_type": "float"}
        if kind == "linear_attention":
            for m in ("linear_attn.in_proj_a", "linear_attn.in_proj_b"):
                extra[p + m] = {"bits": 16, "data_type": "float"}
    return {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4,
            "group_size": GROUP, "sym": True, "data_type": "int",
            "block_name_to_quantize": LM + "layers", "extra_config": extra}


def fp8_quant_config(not_converted: list[str]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": sorted(not_converted)}


# ------------------------------------------------------------------ source weights
def bf16_round(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def successor_map(rng: np.random.Generator) -> np.ndarray:
    """succ[t] for every token id of the vocabulary: one cycle through the printable bytes; every
    other token goes to a printable byte."""
    v = vocab_size()
    order = rng.permutation(PRINTABLE)
    succ = rng.choice(PRINTABLE, size=v)
    for k, t in enumerate(order):
        succ[t] = order[(k + 1) % len(order)]
    return succ.astype(np.int64)


class Source:
    """The BF16 source weights (float32 arrays holding BF16 values), by checkpoint name."""

    def __init__(self, seed: int, shared_matter: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.succ = successor_map(self.rng)
        self.trunk: dict[str, np.ndarray] = {}
        self.mtp: dict[str, np.ndarray] = {}
        self.visual: dict[str, np.ndarray] = {}
        self._build()
        if shared_matter:
            self._make_shared_experts_matter()

    def _make_shared_experts_matter(self) -> None:
        """The ``--shared-experts-matter`` variant: greedy decoding follows S only through the shared
        experts of the last layer (and of the MTP layer), so a hybrid whose FP8 shared experts load
        wrong (unscaled, or scaled 1/16) answers differently, not just with a 0.02 logprob shift.

        ``lm_head`` gets a decoy: row D(t) = S(S(t)) also reads the unit embedding of each printable
        t, DECOY_SCALE > LOGIT_SCALE, so without help the decoy wins (8.0 vs 6.4). Every printable
        successor j gets a random unit "answer code" c_j that row j reads with CODE_SCALE. The last
        layer's shared expert is a lookup of the input token: gate and up row k are
        SHARED_SELECT * unit(e_p) for printable p = PRINTABLE[k] (silu(z) * z is ~15.7 for the token
        itself, ~0.03 for any other), down column k writes SHARED_WRITE * c_S(p) (its gate is zero:
        sigmoid 0.5). With it: S ~10.5 vs decoy ~6.8 after the final norm; without it: the decoy.
        """
        v = vocab_size()
        embed = self.trunk[LM + "embed_tokens.weight"]
        unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
        codes = self.rng.standard_normal((v, H))
        codes /= np.linalg.norm(codes, axis=1, keepdims=True)
        head = self.trunk["lm_head.weight"].astype(np.float64)
        for t in PRINTABLE:
            head[self.decoy(t)] += DECOY_SCALE * unit[t]
        for j in PRINTABLE:
            head[j] += CODE_SCALE * codes[j]
        self.trunk["lm_head.weight"] = bf16_round(head)
        act = _silu(SHARED_SELECT * 16.0) * SHARED_SELECT * 16.0  # the selected feature, |e| ~ 16
        for out, p in ((self.trunk, f"{LM}layers.{LAYERS - 1}.mlp."), (self.mtp, "mtp.layers.0.mlp.")):
            gate = np.zeros((SHARED_I, H))
            down = np.zeros((H, SHARED_I))
            for k, t in enumerate(PRINTABLE):
                gate[k] = SHARED_SELECT * unit[t]
                down[:, k] = SHARED_WRITE / (0.5 * act) * codes[int(self.succ[t])]
            out[p + "shared_expert.gate_proj.weight"] = bf16_round(gate)
            out[p + "shared_expert.up_proj.weight"] = bf16_round(gate)
            out[p + "shared_expert.down_proj.weight"] = bf16_round(down)
            out[p + "shared_expert_gate.weight"] = np.zeros((1, H), np.float32)

    def decoy(self, t: int) -> int:
        return int(self.succ[int(self.succ[t])])

    def _noise(self, *shape: int, std: float = NOISE) -> np.ndarray:
        # fan-in H: std scaled by sqrt(DEFAULT_H / H) (1 at the default), so a wider model's layers
        # perturb the residual stream as much as the default's do
        scale = (DEFAULT_H / H) ** 0.5 if shape[-1] == H else 1.0
        return bf16_round(self.rng.standard_normal(shape) * (std * scale))

    def _layer(self, out: dict, p: str, kind: str) -> None:
        z = np.zeros
        out[p + "input_layernorm.weight"] = z(H, np.float32)  # Qwen3.5 RMSNorm scales by (1 + w)
        out[p + "post_attention_layernorm.weight"] = z(H, np.float32)
        if kind == "linear_attention":
            a, kd, vd = p + "linear_attn.", LK_HEADS * LK_DIM, LV_HEADS * LV_DIM
            out[a + "in_proj_qkv.weight"] = self._noise(2 * kd + vd, H)
            out[a + "in_proj_z.weight"] = self._noise(vd, H)
            out[a + "in_proj_b.weight"] = self._noise(LV_HEADS, H)
            out[a + "in_proj_a.weight"] = self._noise(LV_HEADS, H)
            out[a + "conv1d.weight"] = self._noise(2 * kd + vd, 1, CONV_K, std=0.2)
            out[a + "dt_bias"] = np.ones(LV_HEADS, np.float32)
            out[a + "A_log"] = np.log(self.rng.uniform(1.0, 16.0, LV_HEADS)).astype(np.float32)
            out[a + "norm.weight"] = np.ones(LV_DIM, np.float32)  # gated norm: x * w
            out[a + "out_proj.weight"] = self._noise(H, vd)
        else:
            a = p + "self_attn."
            out[a + "q_proj.weight"] = self._noise(2 * HEADS * HEAD_DIM, H)  # query + output gate
            out[a + "k_proj.weight"] = self._noise(KV_HEADS * HEAD_DIM, H)
            out[a + "v_proj.weight"] = self._noise(KV_HEADS * HEAD_DIM, H)
            out[a + "o_proj.weight"] = self._noise(H, HEADS * HEAD_DIM)
            out[a + "q_norm.weight"] = z(HEAD_DIM, np.float32)
            out[a + "k_norm.weight"] = z(HEAD_DIM, np.float32)
        m = p + "mlp."
        out[m + "gate.weight"] = self._noise(EXPERTS, H)
        out[m + "shared_expert_gate.weight"] = self._noise(1, H)
        out[m + "shared_expert.gate_proj.weight"] = self._noise(SHARED_I, H)
        out[m + "shared_expert.up_proj.weight"] = self._noise(SHARED_I, H)
        out[m + "shared_expert.down_proj.weight"] = self._noise(H, SHARED_I)
        for e in range(EXPERTS):
            q = f"{m}experts.{e}."
            out[q + "gate_proj.weight"] = self._noise(MOE_I, H)
            out[q + "up_proj.weight"] = self._noise(MOE_I, H)
            out[q + "down_proj.weight"] = self._noise(H, MOE_I)

    def _build(self) -> None:
        v = vocab_size()
        embed = bf16_round(self.rng.standard_normal((v, H)))
        unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
        head = np.zeros((v, H), np.float32)
        for t in range(256 + len(SPECIALS)):  # padded ids are never inputs
            head[self.succ[t]] += unit[t]
        t = self.trunk
        t[LM + "embed_tokens.weight"] = embed
        for i, kind in enumerate(layer_types()):
            self._layer(t, f"{LM}layers.{i}.", kind)
        t[LM + "norm.weight"] = np.zeros(H, np.float32)
        # |normed h| = sqrt(H): the successor's logit stays ~LOGIT_SCALE * 16 at any width
        t["lm_head.weight"] = bf16_round(head * (LOGIT_SCALE * (DEFAULT_H / H) ** 0.5))
        m = self.mtp
        fc = np.zeros((H, 2 * H), np.float32)
        fc[:, :H] = np.eye(H)  # vLLM feeds fc with [normed embedding ; normed hidden]
        m["mtp.fc.weight"] = fc
        m["mtp.pre_fc_norm_embedding.weight"] = np.zeros(H, np.float32)
        m["mtp.pre_fc_norm_hidden.weight"] = np.zeros(H, np.float32)
        m["mtp.norm.weight"] = np.zeros(H, np.float32)
        self._layer(m, "mtp.layers.0.", "full_attention")
        vz, vh, vi = "model.visual.", VIS["hidden_size"], VIS["intermediate_size"]
        merged = vh * VIS["spatial_merge_size"] ** 2
        vis = self.visual
        vis[vz + "patch_embed.proj.weight"] = self._noise(vh, VIS["in_channels"], VIS["temporal_patch_size"],
                                                          VIS["patch_size"], VIS["patch_size"])
        vis[vz + "patch_embed.proj.bias"] = np.zeros(vh, np.float32)
        vis[vz + "pos_embed.weight"] = self._noise(VIS["num_position_embeddings"], vh)
        b = vz + "blocks.0."
        for n, shape in (("norm1", (vh,)), ("norm2", (vh,))):
            vis[b + n + ".weight"] = np.ones(shape, np.float32)
            vis[b + n + ".bias"] = np.zeros(shape, np.float32)
        for n, o, i in (("attn.qkv", 3 * vh, vh), ("attn.proj", vh, vh), ("mlp.linear_fc1", vi, vh),
                        ("mlp.linear_fc2", vh, vi)):
            vis[b + n + ".weight"] = self._noise(o, i)
            vis[b + n + ".bias"] = np.zeros(o, np.float32)
        vis[vz + "merger.norm.weight"] = np.ones(vh, np.float32)
        vis[vz + "merger.norm.bias"] = np.zeros(vh, np.float32)
        vis[vz + "merger.linear_fc1.weight"] = self._noise(merged, merged)
        vis[vz + "merger.linear_fc1.bias"] = np.zeros(merged, np.float32)
        vis[vz + "merger.linear_fc2.weight"] = self._noise(H, merged)
        vis[vz + "merger.linear_fc2.bias"] = np.zeros(H, np.float32)


# ------------------------------------------------------------------ quantizers
def gptq_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric 4-bit round-to-nearest with zero point 8, GPTQ v1 packing.

    w [out, in] -> qweight int32 [in/8, out], qzeros int32 [in/G, out/8], scales f16 [in/G, out],
    and the dequantized weights [out, in] ((q - 8) * scale)."""
    out_f, in_f = w.shape
    if in_f % GROUP or out_f % 8:
        raise ValueError(f"shape {w.shape} is not GPTQ-packable with group {GROUP}")
    g = w.reshape(out_f, in_f // GROUP, GROUP)
    target = np.maximum(np.abs(g).max(axis=2), 1e-8) / 7.5  # q in [0, 15] covers [-8s, 7s]
    scale = target.astype(np.float16)
    short = scale.astype(np.float32) < target  # never let F16 rounding shrink the range
    scale[short] = np.nextafter(scale[short], np.float16(np.inf))
    s = scale.astype(np.float32)[:, :, None]
    q = np.clip(np.rint(g / s) + 8, 0, 15).astype(np.uint32)
    deq = ((q.astype(np.float32) - 8) * s).reshape(out_f, in_f)
    per_word = q.reshape(out_f, in_f // 8, 8)  # 8 consecutive input rows per word
    packed = np.zeros((in_f // 8, out_f), np.uint32)
    for j in range(8):
        packed |= per_word[:, :, j].T << np.uint32(4 * j)
    qzeros = np.full((in_f // GROUP, out_f // 8), 0x77777777, np.uint32)
    return packed.view(np.int32), qzeros.view(np.int32), np.ascontiguousarray(scale.T), deq


def gptq_unpack(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    u = qweight.view(np.uint32)
    nib = np.stack([(u >> np.uint32(4 * j)) & np.uint32(15) for j in range(8)], axis=1)
    q = nib.reshape(-1, u.shape[1]).astype(np.float32)  # [in, out]
    return ((q - 8) * np.repeat(scales.astype(np.float32), GROUP, axis=0)).T


def _e4m3_table() -> np.ndarray:
    """Value of every non-negative e4m3fn code 0..126 (127 is NaN), increasing."""
    codes = np.arange(127)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7)).astype(np.float64)


E4M3 = _e4m3_table()


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float -> e4m3fn code (nearest value, ties to the even code, saturating at 448)."""
    a = np.minimum(np.abs(np.asarray(x, np.float64)), FP8_MAX)
    hi = np.clip(np.searchsorted(E4M3, a), 1, 126)
    lo = hi - 1
    dlo, dhi = a - E4M3[lo], E4M3[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code.astype(np.uint8) | (np.signbit(x).astype(np.uint8) << 7)).astype(np.uint8)


def e4m3_decode(c: np.ndarray) -> np.ndarray:
    c = np.asarray(c, np.uint8)
    v = E4M3[np.minimum(c & 0x7F, 126)]
    return np.where(c & 0x80, -v, v).astype(np.float32)


def fp8_block(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] -> (e4m3 codes [out, in], weight_scale_inv f32 [ceil(out/B), ceil(in/B)],
    dequantized [out, in]); one scale per BxB block, amax / 448."""
    out_f, in_f = w.shape
    bo, bi = -(-out_f // BLOCK), -(-in_f // BLOCK)
    pad = np.zeros((bo * BLOCK, bi * BLOCK), np.float32)
    pad[:out_f, :in_f] = w
    blocks = pad.reshape(bo, BLOCK, bi, BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))
    sinv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(sinv, BLOCK, 0), BLOCK, 1)[:out_f, :in_f]
    codes = e4m3_encode(w / full)
    return codes, sinv, e4m3_decode(codes) * full


# ------------------------------------------------------------------ safetensors
def _raw(dtype: str, a: np.ndarray) -> bytes:
    if dtype == "BF16":
        u = np.ascontiguousarray(bf16_round(a)).view(np.uint32) >> np.uint32(16)
        return u.astype("<u2").tobytes()
    np_type = {"F16": "<f2", "F32": "<f4", "I32": "<i4", "F8_E4M3": "u1"}[dtype]
    return np.ascontiguousarray(a).astype(np_type).tobytes()


def padding_rows(name: str, a: np.ndarray) -> tuple[int, np.ndarray | None]:
    """(rows to append to ``a`` up to head_rows(), one block of them: None for zeros) for the embedding
    and lm_head; (0, None) for any other tensor or when no padding is asked."""
    rows = head_rows() - a.shape[0] if name in PADDED else 0
    if rows <= 0:
        return 0, None
    if name != "lm_head.weight":
        return rows, None
    rng = np.random.default_rng(12345)  # the same padding in both checkpoints
    return rows, rng.standard_normal((min(rows, PAD_BLOCK), a.shape[1])) * (PAD_LOGIT_STD / H ** 0.5)


def write_safetensors(path: Path, tensors: list[tuple[str, str, np.ndarray]]) -> dict[str, dict]:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for name, dtype, a in tensors:
        b = _raw(dtype, a)
        pad, block = padding_rows(name, a)
        row = len(b) // a.shape[0] if pad else 0
        fill = _raw(dtype, block) if block is not None else bytes(row * min(pad, PAD_BLOCK))
        n = len(b) + pad * row
        header[name] = {"dtype": dtype, "shape": [a.shape[0] + pad, *a.shape[1:]],
                        "data_offsets": [off, off + n]}
        blobs.append((b, pad * row, memoryview(fill)))
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b, left, fill in blobs:
            f.write(b)
            while left > 0:  # padding rows: one block written again and again
                f.write(fill[:left])
                left -= min(left, len(fill))
    return {n: v for n, v in header.items() if n != "__metadata__"}


def write_index(d: Path, files: dict[str, dict[str, dict]]) -> int:
    wmap, total = {}, 0
    for fname, header in files.items():
        for name, h in header.items():
            wmap[name] = fname
            total += h["data_offsets"][1] - h["data_offsets"][0]
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}
    (d / "model.safetensors.index.json").write_text(json.dumps(doc, indent=1))
    return len(wmap)


# ------------------------------------------------------------------ the two checkpoints
def is_int4(name: str) -> bool:
    if not name.startswith(LM + "layers."):
        return False
    return ".mlp.experts." in name or name.endswith(tuple(n + ".weight" for n in INT4_LINEARS))


def is_fp8(name: str) -> bool:
    if not name.startswith((LM + "layers.", "mtp.layers.")):
        return False
    linears = INT4_LINEARS + SHARED_LINEARS
    return ".mlp.experts." in name or name.endswith(tuple(n + ".weight" for n in linears))


def _entries(weights: dict[str, np.ndarray], quantize) -> list[tuple[str, str, np.ndarray]]:
    out = []
    for name, w in weights.items():
        q = quantize(name)
        if q == "int4":
            qw, qz, sc, _ = gptq_pack(w)
            base = name[: -len(".weight")]
            out += [(base + ".qweight", "I32", qw), (base + ".qzeros", "I32", qz),
                    (base + ".scales", "F16", sc)]
        elif q == "fp8":
            codes, sinv, _ = fp8_block(w)
            out += [(name, "F8_E4M3", codes), (name[: -len(".weight")] + ".weight_scale_inv", "F32", sinv)]
        else:
            out.append((name, "F32" if name.endswith("A_log") else "BF16", w))
    return out


def write_int4(d: Path, src: Source) -> dict:
    trunk = _entries(src.trunk, lambda n: "int4" if is_int4(n) else None)
    files = {
        "model-00001-of-00002.safetensors": write_safetensors(d / "model-00001-of-00002.safetensors", trunk),
        "model-00002-of-00002.safetensors": write_safetensors(
            d / "model-00002-of-00002.safetensors", _entries(src.visual, lambda n: None)),
    }
    mtp = write_safetensors(d / EXTRA_FILE, _entries(src.mtp, lambda n: None))
    listed = write_index(d, files)  # the MTP file is deliberately not listed (as Intel ships it)
    qc = int4_quant_config()
    (d / "config.json").write_text(json.dumps(dict(model_config(), quantization_config=qc), indent=1))
    (d / "quantization_config.json").write_text(json.dumps(qc, indent=1))
    return {"listed": listed, "mtp_unlisted": len(mtp)}


def write_fp8(d: Path, src: Source) -> dict:
    first = _entries({**src.trunk}, lambda n: "fp8" if is_fp8(n) else None)
    second = _entries({**src.visual, **src.mtp}, lambda n: "fp8" if is_fp8(n) else None)
    files = {
        "model-00001-of-00002.safetensors": write_safetensors(d / "model-00001-of-00002.safetensors", first),
        "model-00002-of-00002.safetensors": write_safetensors(d / "model-00002-of-00002.safetensors", second),
    }
    listed = write_index(d, files)
    every = {**src.trunk, **src.visual, **src.mtp}
    keep = [n[: -len(".weight")] for n, w in every.items() if n.endswith(".weight") and w.ndim == 2
            and not is_fp8(n)]
    cfg = dict(model_config(), quantization_config=fp8_quant_config(keep))
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"listed": listed, "fp8_weights": sum(1 for n, t, _ in first + second if t == "F8_E4M3")}


def generate(out: Path, seed: int = 0, shared_matter: bool = False, hidden: int | None = None,
             rows: int | None = None) -> dict:
    """Write out/int4 and out/fp8 (into a temporary sibling, renamed into place); the summary. ``hidden``
    (a multiple of 128) and ``rows`` (config vocab_size, >= vocab_size()) give the head another shape."""
    global H, _HEAD_ROWS
    hidden = hidden or DEFAULT_H
    if hidden % GROUP or (rows or vocab_size()) < vocab_size() or (shared_matter and hidden != DEFAULT_H):
        raise ValueError(f"hidden {hidden} must be a multiple of {GROUP}, rows {rows} at least "
                         f"{vocab_size()} (and --shared-experts-matter is built for hidden {DEFAULT_H})")
    saved = H, _HEAD_ROWS
    H, _HEAD_ROWS = hidden, rows
    try:
        return _generate(out, seed, shared_matter)
    finally:
        H, _HEAD_ROWS = saved


def _generate(out: Path, seed: int, shared_matter: bool) -> dict:
    out = out.resolve()
    if out.exists():
        if not (out / MARKER).is_file():
            raise FileExistsError(f"{out} exists and was not written by tiny_pair.py; choose another OUT")
        shutil.rmtree(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    src = Source(seed, shared_matter)
    info: dict[str, object] = {"int4": str(out / "int4"), "fp8": str(out / "fp8"), "seed": seed,
                               "shared_experts_matter": shared_matter, "hidden": H, "vocab_size": head_rows(),
                               "tokenizer_tokens": 256 + len(SPECIALS)}
    for sub, writer in (("int4", write_int4), ("fp8", write_fp8)):
        d = tmp / sub
        d.mkdir(parents=True)
        write_tokenizer(d)
        info[sub + "_files"] = writer(d, src)
    successors = {chr(t): chr(int(src.succ[t])) for t in PRINTABLE}
    info["successors"] = "".join(successors[c] for c in map(chr, PRINTABLE))
    (tmp / MARKER).write_text(json.dumps({"seed": seed, "successor_of_printable": info["successors"],
                                          "shared_experts_matter": shared_matter, "hidden": H,
                                          "vocab_size": head_rows()}))
    tmp.rename(out)
    return info


def scaled_shared_experts(hybrid: Path, out: Path, factor: float) -> dict:
    """A copy of ``hybrid`` at ``out`` with every shared-expert ``weight_scale_inv`` multiplied by ``factor``
    (F32, rewritten in place in the copy): the negative control of the GPU run. 1/16 is, in effect, the
    shared experts removed (each of the three matrices 16x smaller). Returns what was changed."""
    hybrid, out = hybrid.resolve(), out.resolve()
    if out.exists():
        if not (out / ".sparkllm_negative_control.json").is_file():
            raise FileExistsError(f"{out} exists and is not a negative-control copy; choose another path")
        shutil.rmtree(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(hybrid, tmp)
    changed = []
    for f in sorted(tmp.glob("*.safetensors")):
        (n,) = struct.unpack("<Q", f.read_bytes()[:8])
        header = json.loads(f.read_bytes()[8:8 + n])
        with open(f, "r+b") as fh:
            for name, e in header.items():
                if ".shared_expert." not in name or not name.endswith(".weight_scale_inv"):
                    continue
                if e["dtype"] != "F32":
                    raise ValueError(f"{f.name}: {name} is {e['dtype']}, expected F32")
                a, b = e["data_offsets"]
                fh.seek(8 + n + a)
                vals = np.frombuffer(fh.read(b - a), "<f4") * np.float32(factor)
                fh.seek(8 + n + a)
                fh.write(vals.astype("<f4").tobytes())
                changed.append(name)
    (tmp / ".sparkllm_negative_control.json").write_text(json.dumps({"from": str(hybrid), "factor": factor,
                                                                     "scales": changed}))
    tmp.rename(out)
    return {"path": str(out), "factor": factor, "scales": len(changed)}


def greedy_continuation(text_last_char: str, n: int, seed: int = 0) -> str:
    """What the successor machine generates after a prompt ending in ``text_last_char``."""
    succ = successor_map(np.random.default_rng(seed))
    t, out = ord(text_last_char), []
    for _ in range(n):
        t = int(succ[t])
        out.append(chr(t))
    return "".join(out)


def write_drafter(out: Path, marker: str, prog: str, config: dict, write_weights, seed: int,
                  tokenizer_from: Path | None = None) -> dict:
    """A drafter directory for the tiny target (tiny_eagle3.py, tiny_dflash.py): written in a temporary
    sibling and moved into place; an existing ``out`` is replaced only if it holds ``marker`` (ours).
    ``write_weights(path) -> tensor count`` writes model.safetensors. Tokenizer files are the target's
    (copied from ``tokenizer_from``) or this module's own."""
    out = out.resolve()
    if out.exists():
        if not (out / marker).is_file():
            raise FileExistsError(f"{out} exists and was not written by {prog}; choose another OUT")
        shutil.rmtree(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    n = write_weights(tmp / "model.safetensors")
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / f).is_file():
                shutil.copy(tokenizer_from / f, tmp / f)
    else:
        write_tokenizer(tmp)
    (tmp / marker).write_text(json.dumps({"seed": seed}))
    tmp.rename(out)
    return {"path": str(out), "tensors": n, "bytes": (out / "model.safetensors").stat().st_size}


def drafter_main(prog: str, doc: str, generate, argv: list[str] | None = None) -> int:
    """The command line both drafter generators share: OUT [--seed N] [--tokenizer-from DIR]; exit 0
    written, 1 OUT exists and is not ours, 2 usage."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("out", type=Path, help="output directory (replaced only if this script wrote it)")
    p.add_argument("--seed", type=int, default=0, help="the tiny_pair.py seed of the target (default 0)")
    p.add_argument("--tokenizer-from", type=Path, help="copy the target's tokenizer files from here")
    a = p.parse_args(argv)
    try:
        info = generate(a.out, a.seed, a.tokenizer_from)
    except FileExistsError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tiny_pair.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="output directory (int4/ and fp8/ inside); replaced only "
                   "when an earlier tiny_pair.py run wrote it")
    p.add_argument("--seed", type=int, default=0, help="weights and successor map (default 0)")
    p.add_argument("--shared-experts-matter", action="store_true",
                   help="greedy text follows the successor map only through the last layer's shared "
                        "experts (negative control: without working FP8 shared experts it answers otherwise)")
    p.add_argument("--hidden", type=int, default=DEFAULT_H, help=f"hidden size (default {DEFAULT_H})")
    p.add_argument("--head-rows", type=int, default=None,
                   help="config vocab_size: embedding and lm_head padded to this many rows "
                        f"(default {vocab_size()}, the tokenizer's rounded up)")
    a = p.parse_args(argv)
    try:
        info = generate(a.out, a.seed, a.shared_experts_matter, a.hidden, a.head_rows)
    except ValueError as e:
        print(f"tiny_pair.py: {e}", file=sys.stderr)
        return 2
    except FileExistsError as e:
        print(f"tiny_pair.py: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
