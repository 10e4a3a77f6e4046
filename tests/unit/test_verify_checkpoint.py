"""verify_checkpoint.py: structure, index agreement, MTP, FP8 scale block shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import hybrid_merge
import pytest
from sparkllm.checkpoint import hybrid as ck
from sparkllm.checkpoint.safetensors_io import INDEX_NAME, TensorSpec, encode_header

from tests.fixtures.make_checkpoints import LM, GenConfig, generate

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "verify_checkpoint.py"


@pytest.fixture
def merged(tmp_path: Path) -> Path:
    pair = generate(tmp_path / "src", GenConfig(layers=4, experts=4))
    out = tmp_path / "out"
    assert (
        hybrid_merge.main(["--int4", str(pair.int4_dir), "--fp8", str(pair.fp8_dir), "--out", str(out)]) == 0
    )
    return out


def verify(d: Path, *flags: str) -> tuple[int, list[str]]:
    r = subprocess.run([sys.executable, str(SCRIPT), str(d), *flags], capture_output=True, text=True)
    return r.returncode, r.stdout.strip().splitlines()


def edit_index(d: Path, fn) -> None:
    doc = json.loads((d / INDEX_NAME).read_text())
    fn(doc)
    (d / INDEX_NAME).write_text(json.dumps(doc))


def test_valid_checkpoint_exit_0(merged: Path) -> None:
    rc, lines = verify(merged, "--expect-mtp", "--expect-hybrid")
    assert rc == 0 and "ok" in lines[0]
    r = subprocess.run([sys.executable, str(SCRIPT), str(merged), "--json"], capture_output=True, text=True)
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["fp8_weights"] == 12 and doc["block_size"] == 16


def test_index_and_files_disagree(merged: Path) -> None:
    name = f"{LM}.layers.0.input_layernorm.weight"

    def damage(doc: dict) -> None:
        doc["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
        doc["weight_map"][name] = "model-00002-of-00003.safetensors"
        doc["weight_map"]["lost.weight"] = "model-00009-of-00009.safetensors"
        doc["metadata"]["total_size"] += 1

    edit_index(merged, damage)
    (merged / "stray.safetensors").write_bytes(encode_header([TensorSpec("s", "U8", (1,))]) + b"\0")
    rc, lines = verify(merged)
    text = "\n".join(lines)
    assert rc == 1
    assert "ghost.weight mapped to model-00001-of-00003.safetensors, which does not hold it" in text
    assert f"tensor {name} mapped to model-00002-of-00003.safetensors instead" in text
    assert "lists model-00009-of-00009.safetensors, which does not exist" in text
    assert "stray.safetensors: present but not listed" in text
    assert "total_size" in text
    assert len(lines) >= 5


def test_unlisted_tensor_and_mtp_expectation(merged: Path) -> None:
    edit_index(merged, lambda d: d["weight_map"].pop("mtp.fc.weight"))
    rc, lines = verify(merged, "--expect-mtp")
    text = "\n".join(lines)
    assert rc == 1 and "tensor mtp.fc.weight not in weight_map" in text
    assert "1 mtp.* tensors of model_extra_tensors.safetensors not registered" in text


def test_no_mtp_registered(merged: Path) -> None:
    def drop(doc: dict) -> None:
        doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if not k.startswith("mtp.")}

    edit_index(merged, drop)
    (merged / ck.EXTRA_FILE).unlink()
    rc, lines = verify(merged, "--expect-mtp")
    assert rc == 1 and any("no mtp.* tensors registered" in line for line in lines)
    rc, lines = verify(merged)
    assert any("total_size" in line for line in lines)


def test_truncated_file(merged: Path) -> None:
    f = merged / "model-00003-of-00003.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 3)
    rc, lines = verify(merged)
    assert rc == 1 and any(str(f) in line and "truncated" in line for line in lines)


def small_fp8_dir(tmp_path: Path, tensors: list[TensorSpec]) -> Path:
    d = tmp_path / "fp8"
    d.mkdir()
    (d / "m.safetensors").write_bytes(encode_header(tensors) + b"\0" * sum(t.nbytes for t in tensors))
    return d


def test_fp8_scales_block_consistency(tmp_path: Path) -> None:
    ok = small_fp8_dir(
        tmp_path,
        [
            TensorSpec("a.weight", "F8_E4M3", (300, 256)),
            TensorSpec("a.weight_scale_inv", "F32", (3, 2)),
            TensorSpec("b.weight", "F8_E4M3", (128, 129)),
            TensorSpec("b.weight_scale_inv", "F32", (1, 2)),
        ],
    )
    report = ck.verify_checkpoint(ok)
    assert report.ok, report.problems
    assert report.block_size == 128

    bad = tmp_path / "bad"
    bad.mkdir()
    specs = [
        TensorSpec("a.weight", "F8_E4M3", (256, 256)),
        TensorSpec("a.weight_scale_inv", "F32", (2, 2)),  # block 128
        TensorSpec("b.weight", "F8_E4M3", (256, 256)),
        TensorSpec("b.weight_scale_inv", "F32", (4, 4)),  # block 64
        TensorSpec("c.weight", "F8_E4M3", (16, 16)),  # no scale
        TensorSpec("d.weight", "F8_E4M3", (16, 16)),
        TensorSpec("d.weight_scale_inv", "F32", (1,)),  # wrong rank
        TensorSpec("m.layers.0.mlp.experts.0.up_proj.weight", "F8_E4M3", (16, 16)),
        TensorSpec("m.layers.0.mlp.experts.0.up_proj.weight_scale_inv", "F32", (1, 1)),
    ]
    (bad / "m.safetensors").write_bytes(encode_header(specs) + b"\0" * sum(t.nbytes for t in specs))
    rc, lines = verify(bad, "--expect-hybrid")
    text = "\n".join(lines)
    assert rc == 1
    assert "do not share one block size" in text
    assert "c.weight has no c.weight_scale_inv partner" in text
    assert "rank differs" in text
    assert "expert tensor m.layers.0.mlp.experts.0.up_proj.weight is FP8" in text


def test_expect_hybrid_needs_fp8(tmp_path: Path) -> None:
    d = small_fp8_dir(tmp_path, [TensorSpec("a.weight", "BF16", (4, 4))])
    rc, lines = verify(d, "--expect-hybrid")
    assert rc == 1 and "no F8_E4M3 weights" in lines[0]


@pytest.mark.parametrize(
    ("n", "s", "expected"),
    [
        (256, 2, (128, 255)),
        (300, 3, (100, 149)),
        (128, 1, (128, float("inf"))),
        (10, 20, None),
        (7, 3, (3, 3)),
    ],
)
def test_block_range(n: int, s: int, expected) -> None:
    assert ck.block_range(n, s) == expected
    if expected:
        lo, hi = expected
        assert -(-n // lo) == s
        if hi != float("inf"):
            assert -(-n // int(hi)) == s and -(-n // (int(hi) + 1)) != s


def test_tool_call_tokens_are_required_when_asked(merged: Path, tmp_path: Path) -> None:
    """The fixture's placeholder tokenizer has no <tool_call>: refused with the consequence and the fix;
    a tokenizer that has them (the GPU run's tiny pair, like Qwen's) passes."""
    rc, lines = verify(merged, "--expect-tool-tokens")
    assert rc == 1
    wanted = ("<tool_call> / </tool_call>", "HTTP 500", "vllm_enable_auto_tool_choice")
    assert any(all(w in ln for w in wanted) for ln in lines), lines
    assert verify(merged)[0] == 0  # not asked: not checked
    from tests.gpu import tiny_pair

    good = tmp_path / "tok"
    good.mkdir()
    tiny_pair.write_tokenizer(good)
    assert ck.check_tool_tokens(good) == []
    doc = json.loads((good / "tokenizer.json").read_text())
    doc["added_tokens"] = [a for a in doc["added_tokens"] if a["content"] != "</tool_call>"]
    (good / "tokenizer.json").write_text(json.dumps(doc))
    (problem,) = ck.check_tool_tokens(good)
    assert "no </tool_call> token" in problem
    (good / "tokenizer.json").unlink()
    assert "missing or unreadable" in ck.check_tool_tokens(good)[0]
