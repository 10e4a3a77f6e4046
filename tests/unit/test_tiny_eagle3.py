"""tests/gpu/tiny_eagle3.py: the tiny EAGLE-3 drafter's layout (what vLLM 0.20.0's llama_eagle3.py loads)
and its built-in behaviour (lm_head maps the embedding of t to S(S(t)))."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.gpu import tiny_eagle3, tiny_pair


def read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def test_layout(tmp_path):
    info = tiny_eagle3.generate(tmp_path / "d")
    d = Path(info["path"])
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    # three distinct target layers (vLLM's default gives (2, 2, 1) for 4 layers: fc sees 2 x hidden)
    assert len(set(ids)) == 3 and all(0 <= i <= tiny_pair.LAYERS for i in ids)
    h = read_header(d / "model.safetensors")
    H = tiny_pair.H
    assert h["fc.weight"]["shape"] == [H, 3 * H]
    assert h["midlayer.self_attn.q_proj.weight"]["shape"][1] == 2 * H
    assert h["d2t"]["dtype"] == "I64" and h["t2d"]["dtype"] == "BOOL"
    assert not any(k.startswith("embed_tokens") for k in h)  # shared with the target
    assert (d / "tokenizer.json").is_file()


def test_lm_head_predicts_successor_of_successor():
    src = tiny_pair.Source(0)
    emb = src.trunk[tiny_pair.LM + "embed_tokens.weight"]
    head = dict((n, a) for n, _, a in tiny_eagle3.tensors(0))["lm_head.weight"]
    for t in tiny_pair.PRINTABLE[:20]:
        assert int(np.argmax(head @ emb[t])) == int(src.succ[src.succ[t]])


def test_refuses_foreign_dir(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(FileExistsError):
        tiny_eagle3.generate(tmp_path / "x")
