"""hybrid_merge.py: merge rules, streaming output, atomicity, idempotence, corrupt input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import hybrid_merge
import pytest
from safetensors import safe_open
from sparkllm.checkpoint import hybrid as ck
from sparkllm.checkpoint.safetensors_io import INDEX_NAME, TensorInfo, read_header, read_index
from sparkllm.checkpoint.safetensors_io import read_tensor_bytes as tensor_bytes
from sparkllm.outdir import MARKER

from tests.fixtures.make_checkpoints import LM, GenConfig, GeneratedPair, generate

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hybrid_merge.py"
CFG = GenConfig(layers=4, experts=4)


@pytest.fixture
def pair(tmp_path: Path) -> GeneratedPair:
    return generate(tmp_path / "src", CFG)



def locate(directory: Path, name: str) -> Path:
    idx = directory / INDEX_NAME
    if idx.is_file():
        wm = read_index(idx).weight_map
        if name in wm:
            return directory / wm[name]
    for f in directory.glob("*.safetensors"):
        if name in read_header(f).tensors:
            return f
    raise KeyError(name)


def merge(pair: GeneratedPair, out: Path, *extra: str) -> int:
    return hybrid_merge.main(
        ["--int4", str(pair.int4_dir), "--fp8", str(pair.fp8_dir), "--out", str(out), *extra]
    )


def test_merge_takes_exactly_the_shared_expert_fp8_weights(pair: GeneratedPair, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert merge(pair, out) == 0
    idx = read_index(out / INDEX_NAME)
    fp8_names = set()
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as s:
            keys = set(s.keys())
            assert keys == {n for n, v in idx.weight_map.items() if v == f.name}
            fp8_names |= {k for k in keys if s.get_slice(k).get_dtype() == "F8_E4M3"}
    assert fp8_names == set(pair.expected_taken)
    for name in pair.expected_taken:
        src = locate(pair.fp8_dir, name)
        assert tensor_bytes(locate(out, name), name) == tensor_bytes(src, name)
        sname = ck.scale_name(name)
        assert idx.weight_map[sname] == idx.weight_map[name]
        assert tensor_bytes(locate(out, sname), sname) == tensor_bytes(locate(pair.fp8_dir, sname), sname)
    # every other INT4 tensor unchanged, byte for byte, in the shard of the same name
    for shard in sorted(pair.int4_dir.glob("model-*.safetensors")):
        for name in read_header(shard).tensors:
            if name not in pair.expected_taken:
                assert idx.weight_map[name] == shard.name
                assert tensor_bytes(out / shard.name, name) == tensor_bytes(shard, name)
    # total_size exact, names unique, verifier happy
    assert idx.total_size == sum(
        t.nbytes for f in out.glob("*.safetensors") for t in read_header(f).tensors.values()
    )
    report = ck.verify_checkpoint(out, expect_mtp=True, expect_hybrid=True)
    assert report.ok, report.problems
    assert report.block_size == CFG.block


def test_mtp_carried_from_int4_not_fp8(pair: GeneratedPair, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert merge(pair, out) == 0
    wm = read_index(out / INDEX_NAME).weight_map
    mtp = {n for n in wm if n.startswith("mtp.")}
    assert mtp == set(pair.mtp_names)
    assert all(wm[n] == ck.EXTRA_FILE for n in mtp)
    extra = read_header(out / ck.EXTRA_FILE)
    assert {t.dtype for t in extra.tensors.values()} <= {"BF16"}
    assert not any(n.endswith("weight_scale_inv") for n in mtp)
    name = "mtp.layers.0.mlp.shared_expert.gate_proj.weight"
    assert tensor_bytes(out / ck.EXTRA_FILE, name) == tensor_bytes(pair.int4_dir / ck.EXTRA_FILE, name)


def test_decoys_skipped_with_reasons(pair: GeneratedPair, tmp_path: Path) -> None:
    plan = ck.plan_merge(pair.int4_dir, pair.fp8_dir)
    reasons = {s.name: s.reason for s in plan.skipped}
    assert reasons[f"{LM}.layers.0.mlp.shared_expert_gate.weight"].startswith("shape mismatch")
    assert reasons[f"{LM}.layers.0.mlp.gate.weight"].startswith("no scale")
    assert reasons[f"{LM}.layers.1.mlp.experts.2.up_proj.weight"] == "expert"
    assert reasons["mtp.layers.0.mlp.shared_expert.up_proj.weight"].startswith("mtp")
    assert reasons[f"{LM}.layers.3.self_attn.q_proj.weight"] == "no INT4 tensor of that name"
    assert plan.taken == pair.expected_taken and len(plan.mtp) == len(pair.mtp_names)


def test_fp8_replacement_rules_on_synthetic_entries() -> None:
    def src(name: str, dtype: str, shape: tuple[int, ...]) -> ck.TensorSource:
        return ck.TensorSource(header=None, info=TensorInfo(name, dtype, shape, 0, 0))  # type: ignore[arg-type]

    w = "m.layers.0.mlp.shared_expert.up_proj.weight"
    fp8 = {w: src(w, "F8_E4M3", (4, 4)), ck.scale_name(w): src(ck.scale_name(w), "F32", (1, 1))}
    assert ck.fp8_replacement(TensorInfo(w, "BF16", (4, 4), 0, 32), fp8)[0] is not None
    assert ck.fp8_replacement(TensorInfo(w, "F16", (4, 4), 0, 32), fp8)[0] is not None
    assert "not 16-bit" in ck.fp8_replacement(TensorInfo(w, "F32", (4, 4), 0, 64), fp8)[1]
    assert "shape mismatch" in ck.fp8_replacement(TensorInfo(w, "BF16", (4, 2), 0, 16), fp8)[1]
    e = "m.layers.0.mlp.experts.1.up_proj.weight"
    fp8[e] = src(e, "F8_E4M3", (4, 4))
    fp8[ck.scale_name(e)] = src(ck.scale_name(e), "F32", (1, 1))
    assert ck.fp8_replacement(TensorInfo(e, "BF16", (4, 4), 0, 32), fp8)[1] == "expert"
    del fp8[ck.scale_name(w)]
    assert ck.fp8_replacement(TensorInfo(w, "BF16", (4, 4), 0, 32), fp8)[1].startswith("no scale")
    assert ck.scale_name(w) == "m.layers.0.mlp.shared_expert.up_proj.weight_scale_inv"


@pytest.mark.parametrize("lists_mtp", [False, True])
def test_int4_index_with_or_without_mtp_names(tmp_path: Path, lists_mtp: bool) -> None:
    pair = generate(tmp_path / "src", replace(CFG, index_lists_mtp=lists_mtp))
    listed = {n for n in read_index(pair.int4_dir / INDEX_NAME).weight_map if n.startswith("mtp.")}
    assert bool(listed) == lists_mtp
    out = tmp_path / "out"
    assert merge(pair, out) == 0
    wm = read_index(out / INDEX_NAME).weight_map
    assert {n for n in wm if n.startswith("mtp.")} == set(pair.mtp_names)
    assert len(wm) == len(set(wm))


def test_fp8_extract_dir_gives_same_output_as_full(tmp_path: Path) -> None:
    full = generate(tmp_path / "full", CFG)
    ext = generate(tmp_path / "ext", replace(CFG, fp8_mode="extract"))
    assert not (ext.fp8_dir / INDEX_NAME).exists()
    assert merge(full, tmp_path / "o1") == 0 and merge(ext, tmp_path / "o2") == 0
    for f in (tmp_path / "o1").glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "o2" / f.name).read_bytes()


def test_side_files_and_provenance(pair: GeneratedPair, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert merge(pair, out) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (pair.int4_dir / name).read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((pair.int4_dir / "config.json").read_text())
    prov = cfg.pop(hybrid_merge.PROVENANCE_KEY)
    assert cfg == src_cfg  # loading semantics unchanged
    assert prov["int4"]["repo"] == "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
    assert prov["fp8"]["repo"] == "Qwen/Qwen3.5-122B-A10B-FP8"
    assert prov["counts"]["taken_from_fp8"] == len(pair.expected_taken)
    assert prov["counts"]["mtp_registered"] == len(pair.mtp_names)


def test_dry_run_prints_plan_and_writes_nothing(pair: GeneratedPair, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert merge(pair, out, "--dry-run") == 0
    text = capsys.readouterr().out
    assert "taken from FP8 (12 weights + 12 scales)" in text
    assert "shape mismatch" in text and "expert" in text and "no scale" in text
    assert f"MTP registered from {ck.EXTRA_FILE}: {len(pair.mtp_names)}" in text
    assert not out.exists()
    assert merge(pair, out, "--dry-run", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["taken_from_fp8"] == pair.expected_taken
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


def test_rerun_is_noop_and_input_change_triggers_merge(pair: GeneratedPair, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert merge(pair, out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["changed"] is True
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert merge(pair, out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["changed"] is False
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # a damaged output is not trusted
    shard = next(out.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    assert merge(pair, out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["changed"] is True
    assert ck.verify_checkpoint(out, expect_mtp=True).ok
    # a changed input is merged again
    os.utime(pair.int4_dir / "tokenizer.json", ns=(1, 1))
    assert merge(pair, out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["changed"] is True


def test_crash_mid_merge_leaves_no_output_and_rerun_succeeds(
    pair: GeneratedPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "out"
    calls = {"n": 0}
    real = hybrid_merge.copy_ranges

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(hybrid_merge, "copy_ranges", failing)
    assert merge(pair, out) == 1
    assert "No space left" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    monkeypatch.setattr(hybrid_merge, "copy_ranges", real)
    # a hard kill leaves a (marked) temp dir behind: the next run removes it
    stale = tmp_path / "out.tmp-999999999"
    stale.mkdir()
    (stale / "model-00001-of-00003.safetensors").write_bytes(b"partial")
    (stale / MARKER).write_text('{"tool": "hybrid_merge"}')
    old = tmp_path / "out.old-999999998"  # killed between the two renames
    old.mkdir()
    (old / hybrid_merge.RECORD_NAME).write_text("{}")  # an output of an older version
    foreign = tmp_path / "out.tmp-999999997"  # same name pattern, not ours: left alone
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert merge(pair, out) == 0
    assert not stale.exists() and not old.exists()
    assert (foreign / "notes.txt").read_text() == "mine"
    assert ck.verify_checkpoint(out, expect_mtp=True, expect_hybrid=True).ok


def test_own_earlier_output_replaced_atomically(pair: GeneratedPair, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert merge(pair, out) == 0
    (out / "junk.safetensors").write_bytes(b"x")  # our output, damaged: replaced as a whole
    shard = next(out.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    assert merge(pair, out) == 0
    assert not (out / "junk.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out.")] == []


def test_empty_existing_output_is_used(pair: GeneratedPair, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert merge(pair, out) == 0
    assert ck.verify_checkpoint(out, expect_mtp=True, expect_hybrid=True).ok
    assert json.loads((out / MARKER).read_text())["tool"] == "hybrid_merge"


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_input_shard_fails_before_anything_moves(
    pair: GeneratedPair, tmp_path: Path, damage: str
) -> None:
    out = tmp_path / "out"
    assert merge(pair, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    shard = pair.int4_dir / "model-00002-of-00003.safetensors"
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 100)
    else:
        data = bytearray(shard.read_bytes())
        data[8:12] = b"\xff\xfe[["
        shard.write_bytes(bytes(data))
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--int4",
            str(pair.int4_dir),
            "--fp8",
            str(pair.fp8_dir),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "model-00002-of-00003.safetensors" in r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob("out.tmp-*"))


def test_corrupt_fp8_shard_named(pair: GeneratedPair, tmp_path: Path, capsys) -> None:
    shard = pair.fp8_dir / "model-00001-of-00002.safetensors"
    with open(shard, "ab") as f:
        f.write(b"extra")
    assert merge(pair, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert str(shard) in err and "trailing bytes" in err
    assert not (tmp_path / "out").exists()


def test_usage_errors_and_missing_dirs_exit_2(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        hybrid_merge.main(["--int4", "x"])
    assert exc.value.code == 2
    assert (
        hybrid_merge.main(
            ["--int4", str(tmp_path / "no"), "--fp8", str(tmp_path), "--out", str(tmp_path / "o")]
        )
        == 2
    )
    assert "--int4 directory does not exist" in capsys.readouterr().err


def test_help_documents_rules_and_layout() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for text in ("--dry-run", "weight_scale_inv", "one output shard per INT4 shard", "Exit codes"):
        assert text in r.stdout


def test_bookkeeping_files_of_the_source_stay_behind(pair: GeneratedPair, tmp_path: Path) -> None:
    """A mirror's manifest or hidden records must not end up in the served model; configs must."""
    (pair.int4_dir / ck.MANIFEST_NAME).write_text("{}")
    (pair.int4_dir / ".sparkllm_mirror.json").write_text("{}")
    out = tmp_path / "out"
    assert merge(pair, out) == 0
    names = {p.name for p in out.iterdir()}
    assert ck.MANIFEST_NAME not in names
    assert ".sparkllm_mirror.json" not in names
    assert "config.json" in names


@pytest.mark.parametrize("dry_run", [False, True])
def test_an_int4_copy_as_fp8_is_refused_with_one_line(
    pair: GeneratedPair, tmp_path: Path, dry_run: bool
) -> None:
    """issue 24: --fp8 pointed at a second copy of the INT4 checkpoint merged nothing and exited 0."""
    copy = generate(tmp_path / "copy", CFG).int4_dir  # a second INT4 checkpoint, passed as --fp8
    out = tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "--int4", str(pair.int4_dir), "--fp8", str(copy), "--out", str(out)]
    r = subprocess.run(argv + (["--dry-run"] if dry_run else []), capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "contributes no FP8 weight" in lines[0]
    assert "second copy of the INT4 checkpoint" in lines[0] and str(copy) in lines[0]
    assert r.stdout == "" and not out.exists()
    assert not list(tmp_path.glob("out.tmp-*")) and not (tmp_path / "out.parts").exists()


def test_an_fp8_input_of_another_model_is_refused_naming_the_mismatch(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    other = generate(tmp_path / "other", replace(CFG, hidden=CFG.hidden * 2)).fp8_dir  # FP8, wrong shapes
    out = tmp_path / "out"
    with pytest.raises(ck.CheckpointError, match="contributes no FP8 weight: none of its .* shape mismatch"):
        hybrid_merge.run(pair.int4_dir, other, out)
    assert not out.exists()
