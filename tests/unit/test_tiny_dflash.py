"""tests/gpu/tiny_dflash.py: the tiny DFlash drafter the real-GPU run serves on vLLM 0.26.0.

Checks the config against what vLLM 0.26.0's DFlash model reads (mixed sliding/full layers, the
window, mask id, target layers), the file's names and shapes against the module's parameters, and the
drafting arithmetic the weights encode (the first draft is the target's next token).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from sparkllm.checkpoint.safetensors_io import read_header  # noqa: E402

from tests.gpu import tiny_dflash as td  # noqa: E402
from tests.gpu import tiny_pair as tp  # noqa: E402


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dflash") / "d"
    td.generate(out)
    return out


def test_config_is_a_mixed_window_dflash_drafter(drafter):
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]  # vLLM 0.26.0 registry -> DFlashQwen3ForCausalLM
    kinds = set(cfg["layer_types"])
    assert kinds == {"sliding_attention", "full_attention"}  # mixed: needs the V2 model runner
    d = cfg["dflash_config"]
    assert d["swa_window_size"] == td.WINDOW
    assert tp.vocab_size() > d["mask_token_id"] >= 256 + len(tp.SPECIALS)  # a padded row
    assert all(0 <= i < tp.LAYERS - 1 for i in d["target_layer_ids"])  # taps i + 1 exist in the target
    assert len(set(d["target_layer_ids"])) == len(d["target_layer_ids"])
    assert cfg["block_size"] == 16


def test_weights_have_the_shapes_vllm_builds(drafter):
    hdr = {k: {"shape": list(t.shape), "dtype": t.dtype}
           for k, t in read_header(drafter / "model.safetensors").tensors.items()}
    h, hd = tp.H, tp.HEAD_DIM
    assert hdr["fc.weight"]["shape"] == [h, len(td.TARGET_LAYER_IDS) * h]
    assert hdr["lm_head.weight"]["shape"] == [tp.vocab_size(), h]
    assert "embed_tokens.weight" not in hdr  # shared with the target, as the published drafters do
    for i in range(len(td.LAYER_TYPES)):
        assert hdr[f"layers.{i}.self_attn.q_proj.weight"]["shape"] == [tp.HEADS * hd, h]
        assert hdr[f"layers.{i}.self_attn.k_proj.weight"]["shape"] == [tp.KV_HEADS * hd, h]
        assert hdr[f"layers.{i}.self_attn.k_norm.weight"]["shape"] == [hd]
    assert {v["dtype"] for v in hdr.values()} == {"BF16"}


def test_first_draft_is_the_targets_next_token_and_later_ones_are_not():
    src = tp.Source(0)
    first = later = 0
    for b in tp.PRINTABLE:
        drafts = td.simulate(b, 3)
        first += drafts[0] == src.succ[b]
        later += drafts[1] == src.succ[src.succ[b]]
    assert first >= 0.95 * len(tp.PRINTABLE)
    assert later <= 0.1 * len(tp.PRINTABLE)


def test_refuses_to_replace_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert td.main([str(tmp_path / "x")]) == 1
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
