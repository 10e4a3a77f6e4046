#!/usr/bin/env python3
"""A tiny EAGLE-3 drafter for the tiny Qwen3.5-MoE of tiny_pair.py, for the real-GPU run.

    python3 tests/gpu/tiny_eagle3.py OUT [--seed N]

Laid out as the published Llama-style EAGLE-3 drafters are (what vLLM's ``LlamaForCausalLMEagle3``,
model_executor/models/llama_eagle3.py, loads): ``config.json`` with ``architectures:
["LlamaForCausalLMEagle3"]``, one decoder layer stored as ``midlayer.*`` (its q/k/v take
[embedding ; hidden], 2 x hidden wide), ``fc`` [hidden, 3 x target hidden] over the three auxiliary
hidden states of the target, ``hidden_norm``, ``norm``, ``lm_head`` [draft vocab, hidden], ``d2t``
(draft -> target id offsets, all 0: the draft vocabulary is the target's) and ``t2d``; no
``embed_tokens`` (vLLM shares the target's). Tokenizer files are the target's (copied from
``--tokenizer-from`` when given).

The weights make drafts checkable, not only counted: attention and MLP are zero, ``fc`` passes the
first auxiliary hidden state (which in the tiny model is close to the embedding of the current
token t), and ``lm_head`` maps that to S(S(t)) (S: tiny_pair's successor machine). So the first
draft token after the target's own next token S(t) is right and later ones (which see the drafter's
unchanged hidden state again) are not: acceptance near 1 at position 0, near 0 after it.

Prints one JSON line (path, tensor count, bytes). Exit 0 written, 1 the output exists and is not
ours, 2 usage.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from tests.gpu import tiny_pair

MARKER = ".sparkllm_tiny_eagle3.json"
INTER = 512


def config() -> dict:
    h, v = tiny_pair.H, tiny_pair.vocab_size()
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": h, "target_hidden_size": h, "intermediate_size": INTER,
            "num_hidden_layers": 1, "num_attention_heads": tiny_pair.HEADS,
            "num_key_value_heads": tiny_pair.KV_HEADS, "head_dim": tiny_pair.HEAD_DIM,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": tiny_pair.MAX_POS, "vocab_size": v, "draft_vocab_size": v,
            # vLLM's default for Qwen3.5 targets, (2, L // 2, L - 3), is (2, 2, 1) for 4 layers: two
            # distinct layers, 2 x hidden into fc (seen failing); the ids name three distinct layers
            "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": tiny_pair.special_id("<|endoftext|>"),
            "eos_token_id": tiny_pair.special_id("<|im_end|>"), "torch_dtype": "bfloat16"}


def tensors(seed: int) -> list[tuple[str, str, np.ndarray]]:
    src = tiny_pair.Source(seed)
    h, v = tiny_pair.H, tiny_pair.vocab_size()
    embed = src.trunk[tiny_pair.LM + "embed_tokens.weight"]
    unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    head = np.zeros((v, h), np.float32)
    for t in range(256 + len(tiny_pair.SPECIALS)):
        head[src.succ[src.succ[t]]] += unit[t]
    fc = np.zeros((h, 3 * h), np.float32)
    fc[:, :h] = np.eye(h)
    qd, kd = tiny_pair.HEADS * tiny_pair.HEAD_DIM, tiny_pair.KV_HEADS * tiny_pair.HEAD_DIM
    z = np.zeros
    m = "midlayer."
    bf16 = [("fc.weight", fc), ("norm.weight", np.ones(h, np.float32)),
            ("lm_head.weight", head * tiny_pair.LOGIT_SCALE),
            (m + "input_layernorm.weight", np.ones(h, np.float32)),
            (m + "hidden_norm.weight", np.ones(h, np.float32)),
            (m + "post_attention_layernorm.weight", np.ones(h, np.float32)),
            (m + "self_attn.q_proj.weight", z((qd, 2 * h), np.float32)),
            (m + "self_attn.k_proj.weight", z((kd, 2 * h), np.float32)),
            (m + "self_attn.v_proj.weight", z((kd, 2 * h), np.float32)),
            (m + "self_attn.o_proj.weight", z((h, qd), np.float32)),
            (m + "mlp.gate_proj.weight", z((INTER, h), np.float32)),
            (m + "mlp.up_proj.weight", z((INTER, h), np.float32)),
            (m + "mlp.down_proj.weight", z((h, INTER), np.float32))]
    return [(n, "BF16", a) for n, a in bf16]


def write(path: Path, items: list[tuple[str, str, np.ndarray]], v: int) -> int:
    """tiny_pair's BF16 tensors plus the two index maps (I64 d2t, BOOL t2d)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    extra = [("d2t", "I64", np.zeros(v, "<i8").tobytes(), [v]),
             ("t2d", "BOOL", np.ones(v, np.uint8).tobytes(), [v])]
    rows = [(n, d, tiny_pair._raw(d, a), list(a.shape)) for n, d, a in items] + extra
    for name, dtype, b, shape in rows:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for b in blobs:
            f.write(b)
    return len(rows)


def generate(out: Path, seed: int = 0, tokenizer_from: Path | None = None) -> dict:
    cfg = config()
    return tiny_pair.write_drafter(out, MARKER, "tiny_eagle3.py", cfg,
                                   lambda path: write(path, tensors(seed), cfg["vocab_size"]), seed,
                                   tokenizer_from)


def main(argv: list[str] | None = None) -> int:
    return tiny_pair.drafter_main("tiny_eagle3.py", __doc__, generate, argv)


if __name__ == "__main__":
    sys.exit(main())
