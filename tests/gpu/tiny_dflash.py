#!/usr/bin/env python3
"""A tiny DFlash drafter for the tiny Qwen3.5-MoE of tiny_pair.py, for the real-GPU run on vLLM 0.26.0.

    python3 tests/gpu/tiny_dflash.py OUT [--seed N] [--tokenizer-from DIR]

Laid out as the published Qwen3.5-122B-A10B DFlash drafter is, as far as vLLM 0.26.0 reads it
(``model_executor/models/qwen3_dflash.py``; registry ``DFlashDraftModel`` -> ``DFlashQwen3ForCausalLM``):
``config.json`` with ``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``, a block size of
16, ``dflash_config`` holding ``mask_token_id`` (a padded id of the vocabulary, as the 122B drafter's
248077 is in Qwen's 248320 rows) and ``target_layer_ids`` (the target layers whose hidden states feed
``fc``; vLLM taps layer i + 1's input, ``gpu_model_runner.py`` / ``eagle3_utils.py``), and **mixed
sliding-window and full attention** draft layers (``layer_types``; the window from
``dflash_config.swa_window_size``, qwen3_dflash.py:123-131; mixed layers need the V2 model runner,
qwen3_dflash.py:104-113, which the catalogue's ``server_env`` sets). No ``embed_tokens``: the
drafter shares the target's, as the published ones do. Layer weights are stored under ``layers.N.*``
with separate q/k/v and gate/up projections (vLLM stacks them), ``fc``, ``hidden_norm``, ``norm``,
``lm_head``.

The weights make drafts checkable, not only counted. DFlash drafts a block in one forward pass: the
query is [bonus token b at position p, mask x K at p+1..p+K], and the output at mask position p+i is
the draft for that position (the V2 runner's ``_prepare_dflash_inputs_kernel``). Layer 0 is causal
sliding-window attention with window ``WINDOW`` = 2, q and k zero (uniform weights over the window),
v a fixed orthonormal projection P and o_proj ``GAIN`` x P^T: the mask at p+1 sees b and itself, so
its residual gains a multiple of P^T P n(emb b). Layer 1 is full, non-causal attention with zero
weights (it adds nothing), the MLPs are zero, and ``lm_head`` maps unit(emb t) to S(t) (tiny_pair's
successor machine), as the target's own head does. So the draft at p+1 is S(b), the token the target
produces next, and the later ones (which see only masks) are not: acceptance near 1 at position 0 and
near 0 after it. ``simulate`` replays that arithmetic in numpy (tests/unit/test_tiny_dflash.py).

Prints one JSON line (path, tensor count, bytes). Exit 0 written, 1 the output exists and is not
ours, 2 usage.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from tests.gpu import tiny_pair

MARKER = ".sparkllm_tiny_dflash.json"
INTER = 512
BLOCK_SIZE = 16  # the 122B drafter's block size
WINDOW = 2  # layer 0's sliding window: the bonus token and the mask itself
GAIN = 32.0  # o_proj gain of layer 0: the bonus token's share outweighs the mask embedding
LAYER_TYPES = ["sliding_attention", "full_attention"]
TARGET_LAYER_IDS = [0, 1, 2]  # three distinct target layers (taps 1, 2, 3 of the 4-layer target)


def mask_token_id() -> int:
    """A padded row (never a real token, as the 122B drafter's 248077 is); of the padded rows, one
    whose embedding's own share in layer 0 biases no draft (simulate: 94 of 95 bonus tokens drafted
    right at seed 0)."""
    return tiny_pair.vocab_size() - 4


def config() -> dict:
    h, v = tiny_pair.H, tiny_pair.vocab_size()
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": h, "target_hidden_size": h, "intermediate_size": INTER,
            "num_hidden_layers": len(LAYER_TYPES), "num_attention_heads": tiny_pair.HEADS,
            "num_key_value_heads": tiny_pair.KV_HEADS, "head_dim": tiny_pair.HEAD_DIM,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
            "max_position_embeddings": tiny_pair.MAX_POS, "vocab_size": v,
            "layer_types": LAYER_TYPES, "use_sliding_window": True, "sliding_window": WINDOW,
            "max_window_layers": 0, "block_size": BLOCK_SIZE,
            "dflash_config": {"mask_token_id": mask_token_id(), "target_layer_ids": TARGET_LAYER_IDS,
                              "swa_window_size": WINDOW},
            "tie_word_embeddings": False, "attention_bias": False,
            "bos_token_id": tiny_pair.special_id("<|endoftext|>"),
            "eos_token_id": tiny_pair.special_id("<|im_end|>"), "torch_dtype": "bfloat16"}


def projection(seed: int) -> np.ndarray:
    """P: KV_HEADS x HEAD_DIM orthonormal rows in the hidden space (fixed by the seed)."""
    rng = np.random.default_rng(1000 + seed)
    q, _ = np.linalg.qr(rng.standard_normal((tiny_pair.H, tiny_pair.H)))
    return q[: tiny_pair.KV_HEADS * tiny_pair.HEAD_DIM].astype(np.float32)


@functools.cache
def tensors(seed: int) -> tuple[tuple[str, str, np.ndarray], ...]:
    src = tiny_pair.Source(seed)
    h, v = tiny_pair.H, tiny_pair.vocab_size()
    hd, nkv, nq = tiny_pair.HEAD_DIM, tiny_pair.KV_HEADS, tiny_pair.HEADS
    embed = src.trunk[tiny_pair.LM + "embed_tokens.weight"]
    unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    head = np.zeros((v, h), np.float32)
    for t in range(256 + len(tiny_pair.SPECIALS)):
        head[src.succ[t]] += unit[t]
    p = projection(seed)
    o = np.zeros((h, nq * hd), np.float32)
    group = nq // nkv
    for g in range(nkv):  # the first query head of each KV group writes its value back through P^T
        o[:, g * group * hd:(g * group + 1) * hd] = GAIN * p[g * hd:(g + 1) * hd].T
    z = np.zeros
    out = [("fc.weight", z((h, len(TARGET_LAYER_IDS) * h), np.float32)),
           ("hidden_norm.weight", np.ones(h, np.float32)), ("norm.weight", np.ones(h, np.float32)),
           ("lm_head.weight", head * tiny_pair.LOGIT_SCALE)]
    for i in range(len(LAYER_TYPES)):
        m = f"layers.{i}."
        out += [(m + "input_layernorm.weight", np.ones(h, np.float32)),
                (m + "post_attention_layernorm.weight", np.ones(h, np.float32)),
                (m + "self_attn.q_proj.weight", z((nq * hd, h), np.float32)),
                (m + "self_attn.k_proj.weight", z((nkv * hd, h), np.float32)),
                (m + "self_attn.v_proj.weight", p if i == 0 else z((nkv * hd, h), np.float32)),
                (m + "self_attn.o_proj.weight", o if i == 0 else z((h, nq * hd), np.float32)),
                (m + "self_attn.q_norm.weight", np.ones(hd, np.float32)),
                (m + "self_attn.k_norm.weight", np.ones(hd, np.float32)),
                (m + "mlp.gate_proj.weight", z((INTER, h), np.float32)),
                (m + "mlp.up_proj.weight", z((INTER, h), np.float32)),
                (m + "mlp.down_proj.weight", z((h, INTER), np.float32))]
    return tuple((n, "BF16", tiny_pair.bf16_round(a)) for n, a in out)


def _rms(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def simulate(bonus: int, k: int, seed: int = 0) -> list[int]:
    """The drafts (greedy) for mask positions p+1..p+k after bonus token ``bonus``, by the
    arithmetic of DFlashQwen3Model.forward with these weights (zero q/k: uniform attention over the
    window; zero MLPs; norm weights 1)."""
    w = dict((n, a) for n, _, a in tensors(seed))
    embed = tiny_pair.Source(seed).trunk[tiny_pair.LM + "embed_tokens.weight"]
    ids = [bonus] + [mask_token_id()] * k
    x = embed[ids].astype(np.float64)
    hd, nkv, nq = tiny_pair.HEAD_DIM, tiny_pair.KV_HEADS, tiny_pair.HEADS
    for i, kind in enumerate(LAYER_TYPES):
        m = f"layers.{i}."
        n = _rms(x)
        v = n @ w[m + "self_attn.v_proj.weight"].T  # [T, nkv*hd]
        att = np.zeros((len(ids), nq * hd))
        for t in range(len(ids)):
            keys = range(max(0, t - WINDOW + 1), t + 1) if kind == "sliding_attention" else range(len(ids))
            mean = v[list(keys)].mean(axis=0)
            for qh in range(nq):
                g = qh // (nq // nkv)
                att[t, qh * hd:(qh + 1) * hd] = mean[g * hd:(g + 1) * hd]
        x = x + att @ w[m + "self_attn.o_proj.weight"].T  # MLP is zero: nothing more is added
    logits = _rms(x) @ w["lm_head.weight"].T
    return [int(j) for j in logits[1:].argmax(axis=1)]


def generate(out: Path, seed: int = 0, tokenizer_from: Path | None = None) -> dict:
    items = list(tensors(seed))

    def weights(path: Path) -> int:
        tiny_pair.write_safetensors(path, items)
        return len(items)

    return tiny_pair.write_drafter(out, MARKER, "tiny_dflash.py", config(), weights, seed, tokenizer_from)


def main(argv: list[str] | None = None) -> int:
    return tiny_pair.drafter_main("tiny_dflash.py", __doc__, generate, argv)


if __name__ == "__main__":
    sys.exit(main())
