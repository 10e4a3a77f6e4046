"""tests/gpu/tiny_pair.py: the tiny real-architecture pair the real-GPU run serves.

Checks the two formats (names, dtypes, shapes, both quantization configs), the quantizers against
their own inverse, the "successor machine" the weights encode (so MTP drafts can be accepted), and
that our own pipeline (hybrid merge, MTP index patch, verify) accepts the pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

from sparkllm.checkpoint.safetensors_io import read_header, read_tensor_bytes  # noqa: E402

from tests.gpu import tiny_pair as tp  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pair") / "tiny"
    tp.generate(out, seed=0)
    return out


def headers(d: Path) -> dict[str, tuple[str, list[int], str]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        for name, info in read_header(f).tensors.items():
            out[name] = (info.dtype, list(info.shape), f.name)
    return out


def test_int4_layout_as_intel_ships_it(pair):
    d = pair / "int4"
    h = headers(d)
    lm = "model.language_model.layers"
    # routed experts per expert, GPTQ-packed
    assert h[f"{lm}.0.mlp.experts.7.gate_proj.qweight"][:2] == ("I32", [256 // 8, 128])
    assert h[f"{lm}.0.mlp.experts.7.gate_proj.qzeros"][:2] == ("I32", [256 // 128, 128 // 8])
    assert h[f"{lm}.0.mlp.experts.7.gate_proj.scales"][:2] == ("F16", [256 // 128, 128])
    assert h[f"{lm}.0.mlp.experts.7.down_proj.qweight"][:2] == ("I32", [128 // 8, 256])
    assert f"{lm}.0.mlp.experts.7.gate_proj.weight" not in h
    # DeltaNet in layers 0-2, full attention in layer 3, projections INT4
    assert f"{lm}.0.linear_attn.in_proj_qkv.qweight" in h and f"{lm}.0.self_attn.q_proj.qweight" not in h
    assert h[f"{lm}.3.self_attn.q_proj.qweight"][:2] == ("I32", [256 // 8, 2 * 4 * 64])
    assert h[f"{lm}.1.linear_attn.in_proj_a.weight"][:2] == ("BF16", [4, 256])
    # shared expert and its gate stay 16-bit
    assert h[f"{lm}.2.mlp.shared_expert.up_proj.weight"][:2] == ("BF16", [128, 256])
    assert h[f"{lm}.2.mlp.shared_expert_gate.weight"][:2] == ("BF16", [1, 256])
    # the MTP head: in its own file, not in the index
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = [n for n, v in h.items() if v[2] == tp.EXTRA_FILE]
    assert len(mtp) == 41 and all(n.startswith("mtp.") for n in mtp)
    assert not [n for n in index if n.startswith("mtp.")]
    assert h["mtp.fc.weight"][:2] == ("BF16", [256, 512])
    assert any(n.startswith("model.visual.") for n in index)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["packing_format"], qc["bits"], qc["group_size"], qc["sym"]) == (
        "auto-round", "auto_round:auto_gptq", 4, 128, True)
    assert qc["block_name_to_quantize"] == "model.language_model.layers"
    assert qc["extra_config"][f"{lm}.0.mlp.shared_expert.down_proj"]["bits"] == 16
    assert qc == json.loads((d / "quantization_config.json").read_text())
    text = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_5_moe"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["mtp_num_hidden_layers"] == 1


def test_fp8_layout_as_qwen_ships_it(pair):
    d = pair / "fp8"
    h = headers(d)
    lm = "model.language_model.layers"
    for layer in range(4):
        w = h[f"{lm}.{layer}.mlp.shared_expert.down_proj.weight"]
        s = h[f"{lm}.{layer}.mlp.shared_expert.down_proj.weight_scale_inv"]
        assert w[:2] == ("F8_E4M3", [256, 128]) and s[:2] == ("F32", [2, 1])
    assert h[f"{lm}.0.mlp.experts.3.up_proj.weight"][0] == "F8_E4M3"
    assert h["mtp.layers.0.self_attn.o_proj.weight"][0] == "F8_E4M3"
    assert h[f"{lm}.0.mlp.shared_expert_gate.weight"][0] == "BF16"
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert "mtp.fc.weight" in index
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert qc["activation_scheme"] == "dynamic"
    assert "lm_head" in qc["modules_to_not_convert"]
    assert f"{lm}.0.mlp.shared_expert.down_proj" not in qc["modules_to_not_convert"]


def test_values_are_finite_and_the_quantizers_invert():
    rng = np.random.default_rng(3)
    w = tp.bf16_round(rng.standard_normal((256, 384)) * 0.02)
    qw, qz, sc, deq = tp.gptq_pack(w)
    assert np.array_equal(tp.gptq_unpack(qw, sc), deq)
    bound = np.repeat(sc.astype(np.float32), tp.GROUP, axis=0).T / 2 * 1.0001
    assert (np.abs(deq - w) <= bound).all()
    assert (qz.view(np.uint32) == 0x77777777).all()
    codes, sinv, fdeq = tp.fp8_block(w)
    assert sinv.shape == (2, 3) and not ((codes & 0x7F) == 0x7F).any()
    big = np.abs(w) > np.repeat(np.repeat(sinv, 128, 0), 128, 1) * 2 ** -6
    assert (np.abs(fdeq - w)[big] <= np.abs(w[big]) * 2 ** -4 * 1.0001).all()
    # e4m3: exact values stay exact, 448 saturates, ties go to the even code
    assert np.array_equal(tp.e4m3_decode(tp.e4m3_encode(np.array([0.0, 1.0, -2.5, 448.0, 1000.0]))),
                          np.array([0.0, 1.0, -2.5, 448.0, 448.0], np.float32))
    assert tp.e4m3_encode(np.array([1.0625]))[0] == tp.e4m3_encode(np.array([1.0]))[0]


def test_the_weights_encode_the_successor_machine():
    src = tp.Source(0)
    embed = src.trunk["model.language_model.embed_tokens.weight"]
    head = src.trunk["lm_head.weight"]
    real = 256 + len(tp.SPECIALS)
    normed = embed[:real] / np.sqrt((embed[:real] ** 2).mean(axis=1, keepdims=True))
    logits = normed @ head.T
    assert np.array_equal(logits.argmax(axis=1), src.succ[:real])
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2.0  # room for the layers' small perturbations
    assert set(src.succ[:real]) <= set(tp.PRINTABLE)  # never an end-of-sequence token
    # one cycle through the printable bytes
    t, seen = 65, set()
    for _ in range(len(tp.PRINTABLE)):
        seen.add(t)
        t = int(src.succ[t])
    assert t == 65 and len(seen) == len(tp.PRINTABLE)
    # MTP: fc keeps the embedding half and drops the hidden half
    fc = src.mtp["mtp.fc.weight"]
    assert np.array_equal(fc[:, :256], np.eye(256)) and not fc[:, 256:].any()
    assert tp.greedy_continuation("A", 3) == "".join(
        chr(c) for c in (src.succ[65], src.succ[src.succ[65]], src.succ[src.succ[src.succ[65]]]))
    for name, w in {**src.trunk, **src.mtp, **src.visual}.items():
        assert np.isfinite(w).all(), name


def test_deterministic_and_never_replaces_foreign_output(tmp_path, pair):
    out = tmp_path / "again"
    tp.generate(out, seed=0)
    for f in ("int4/model-00001-of-00002.safetensors", "fp8/model-00002-of-00002.safetensors"):
        assert (out / f).read_bytes() == (pair / f).read_bytes()
    tp.generate(out, seed=0)  # its own earlier output is replaced
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("user data")
    rc = tp.main([str(foreign)])
    assert rc == 1 and (foreign / "keep.txt").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "mine"]


def test_our_pipeline_accepts_the_pair(pair, tmp_path):
    py = sys.executable
    hybrid = tmp_path / "hybrid"
    run = lambda *a: subprocess.run([py, *map(str, a)], capture_output=True, text=True, check=False)  # noqa: E731
    r = run(ROOT / "scripts/hybrid_merge.py", "--int4", pair / "int4", "--fp8", pair / "fp8", "--out", hybrid,
            "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)["summary"]
    assert summary["taken_from_fp8"] == 12 and summary["mtp_registered"] == 41
    r = run(ROOT / "scripts/mtp_index_patch.py", "--source", pair / "int4", "--target", hybrid, "--json")
    assert r.returncode == 0, r.stderr
    r = run(ROOT / "scripts/verify_checkpoint.py", hybrid, "--expect-mtp", "--expect-hybrid", "--json")
    assert r.returncode == 0, r.stdout
    report = json.loads(r.stdout)
    assert (report["fp8_weights"], report["mtp_tensors"], report["block_size"]) == (12, 41, 128)
    # the FP8 bytes in the hybrid are the FP8 release's, byte for byte
    name = "model.language_model.layers.1.mlp.shared_expert.gate_proj.weight"
    fp8_file = pair / "fp8" / "model-00001-of-00002.safetensors"
    wmap = json.loads((hybrid / "model.safetensors.index.json").read_text())["weight_map"]
    hybrid_file = hybrid / wmap[name]
    assert read_tensor_bytes(hybrid_file, name) == read_tensor_bytes(fp8_file, name)


def test_tokenizer_is_byte_level():
    from tokenizers import Tokenizer  # pinned in requirements.txt

    with tempfile.TemporaryDirectory() as t:
        tp.write_tokenizer(Path(t))
        tok = Tokenizer.from_file(str(Path(t) / "tokenizer.json"))
        enc = tok.encode("<|im_start|>user\nhi!<|im_end|>")
        assert enc.ids == [tp.special_id("<|im_start|>"), *b"user\nhi!", tp.special_id("<|im_end|>")]
        assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>user\nhi!<|im_end|>"


# --- the shared-experts-matter variant (issue 34: a negative control that can fail) -----------------

def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)  # Qwen3.5 norms: (1 + w), w = 0 here


def _last_layer_logits(src: tp.Source, shared_scale: float = 1.0, fp8: bool = False) -> np.ndarray:
    """Logits for every printable input token t with the residual stream = its embedding (the earlier
    layers add noise of std 0.02 matrices) through the last layer's shared expert, the final norm and
    lm_head; each shared-expert matrix scaled by ``shared_scale`` (as a 1/16 weight_scale_inv does)
    or FP8-block quantized as the hybrid holds it."""
    p = f"{tp.LM}layers.{tp.LAYERS - 1}.mlp.shared_expert."
    mats = {n: src.trunk[p + n + ".weight"] for n in ("gate_proj", "up_proj", "down_proj")}
    if fp8:
        mats = {n: tp.fp8_block(w)[2] for n, w in mats.items()}
    mats = {n: w * shared_scale for n, w in mats.items()}
    h = src.trunk[tp.LM + "embed_tokens.weight"][tp.PRINTABLE].astype(np.float64)
    x = _rms(h)
    act = tp._silu(x @ mats["gate_proj"].T) * (x @ mats["up_proj"].T)
    gate = 1 / (1 + np.exp(-(x @ src.trunk[p[:-len("shared_expert.")] + "shared_expert_gate.weight"].T)))
    h = h + gate * (act @ mats["down_proj"].T)
    return _rms(h) @ src.trunk["lm_head.weight"].T


def _logprob_top(logits: np.ndarray) -> np.ndarray:
    m = logits.max(-1, keepdims=True)
    return (logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))).max(-1)


def test_with_shared_experts_matter_greedy_follows_s_only_through_them():
    src = tp.Source(0, shared_matter=True)
    succ = src.succ[tp.PRINTABLE]
    decoy = np.array([src.decoy(t) for t in tp.PRINTABLE])
    full = _last_layer_logits(src)
    assert (full.argmax(-1) == succ).all()
    removed = _last_layer_logits(src, shared_scale=1 / 16)
    # removing the shared experts changes the answer on most tokens: the decoy takes over
    assert (removed.argmax(-1) != succ).mean() >= 0.8
    assert (removed.argmax(-1) == decoy).mean() >= 0.8
    # FP8 block quantization (what the hybrid serves) keeps every answer, top logprob within 0.05
    fp8 = _last_layer_logits(src, fp8=True)
    assert (fp8.argmax(-1) == succ).all()
    assert np.abs(_logprob_top(fp8) - _logprob_top(full)).max() < 0.05


def test_in_the_default_pair_the_shared_experts_barely_matter():
    # why the variant exists: 1/16 shared experts leave the default model's answers unchanged
    src = tp.Source(0)
    assert (_last_layer_logits(src, shared_scale=1 / 16).argmax(-1) == src.succ[tp.PRINTABLE]).all()


def test_the_variant_is_recorded_and_the_pipeline_still_accepts_it(tmp_path):
    info = tp.generate(tmp_path / "sm", seed=0, shared_matter=True)
    assert info["shared_experts_matter"] is True
    assert json.loads((tmp_path / "sm" / tp.MARKER).read_text())["shared_experts_matter"] is True


def test_verify_checkpoint_compares_fp8_scales_with_the_source(tmp_path):
    pair = tmp_path / "sm"
    tp.generate(pair, seed=0, shared_matter=True)
    py = sys.executable
    run = lambda *a: subprocess.run([py, *map(str, a)], capture_output=True, text=True, check=False)  # noqa: E731
    hybrid = tmp_path / "hybrid"
    r = run(ROOT / "scripts/hybrid_merge.py", "--int4", pair / "int4", "--fp8", pair / "fp8", "--out", hybrid)
    assert r.returncode == 0, r.stderr
    verify = ROOT / "scripts/verify_checkpoint.py"
    r = run(verify, hybrid, "--expect-hybrid", "--fp8-source", pair / "fp8")
    assert r.returncode == 0, r.stdout
    neg = tp.scaled_shared_experts(hybrid, tmp_path / "neg", 1 / 16)
    assert neg["scales"] == 12
    # every other check passes the 1/16 copy; the source comparison names each of the 12 scales
    assert run(verify, neg["path"], "--expect-hybrid").returncode == 0
    r = run(verify, neg["path"], "--expect-hybrid", "--fp8-source", pair / "fp8")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 12, lines
    assert all("median ratio 0.0625" in ln and "shared_expert" in ln for ln in lines), lines
    assert run(verify, hybrid, "--fp8-source", tmp_path / "nope").returncode == 2
