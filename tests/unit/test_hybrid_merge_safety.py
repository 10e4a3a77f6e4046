"""hybrid_merge.py and verify_checkpoint.py, issue 46: a missing shard is never merged or verified ok, the
final swap survives a kill and a failing rerun, a full disk and a second merge are named, FP8 weights of
another type are refused."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import hybrid_merge
import pytest
from sparkllm.checkpoint import hybrid as ck
from sparkllm.checkpoint.safetensors_io import INDEX_NAME, read_header
from sparkllm.outdir import MARKER

from tests.fixtures.make_checkpoints import LM, GenConfig, GeneratedPair, generate

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CFG = GenConfig(layers=4, experts=4)
SHARD2 = "model-00002-of-00003.safetensors"
ENV = {**os.environ, "PYTHONPATH": str(SCRIPTS)}


@pytest.fixture
def pair(tmp_path: Path) -> GeneratedPair:
    return generate(tmp_path / "src", CFG)


def merge(pair: GeneratedPair, out: Path, int4: Path | None = None, fp8: Path | None = None
          ) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(SCRIPTS / "hybrid_merge.py"), "--int4", str(int4 or pair.int4_dir),
            "--fp8", str(fp8 or pair.fp8_dir), "--out", str(out), "--json"]
    return subprocess.run(argv, capture_output=True, text=True, env=ENV)


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def nothing_written(tmp_path: Path, out: Path) -> bool:
    return not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith((out.name + ".",
                                                                                          f".{out.name}."))]


def test_a_missing_int4_shard_is_refused_before_anything_is_written(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    (pair.int4_dir / SHARD2).unlink()  # its index still names it
    out = tmp_path / "out"
    r = merge(pair, out)
    assert r.returncode == 1
    line = one_line(r)
    assert str(pair.int4_dir / INDEX_NAME) in line and SHARD2 in line and "missing" in line
    assert nothing_written(tmp_path, out)


def test_an_index_naming_a_shard_that_does_not_exist_is_refused(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    doc = json.loads((pair.int4_dir / INDEX_NAME).read_text())
    doc["weight_map"]["ghost.weight"] = "model-00009-of-00009.safetensors"
    (pair.int4_dir / INDEX_NAME).write_text(json.dumps(doc))
    out = tmp_path / "out"
    r = merge(pair, out)
    assert r.returncode == 1 and "model-00009-of-00009.safetensors" in one_line(r)
    assert nothing_written(tmp_path, out)


def test_a_tensor_not_where_the_index_says_is_refused(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    name = f"{LM}.layers.0.input_layernorm.weight"
    doc = json.loads((pair.int4_dir / INDEX_NAME).read_text())
    real = doc["weight_map"][name]
    doc["weight_map"][name] = next(f for f in sorted(set(doc["weight_map"].values())) if f != real)
    (pair.int4_dir / INDEX_NAME).write_text(json.dumps(doc))
    out = tmp_path / "out"
    r = merge(pair, out)
    assert r.returncode == 1 and name in one_line(r)
    assert nothing_written(tmp_path, out)


def shrunk_int4(pair: GeneratedPair, tmp_path: Path) -> Path:
    """A copy of the INT4 checkpoint without one shard whose index was rebuilt to match: consistent in
    itself, so a merge of it looks complete unless it is compared with the real INT4 index."""
    d = tmp_path / "int4-short"
    shutil.copytree(pair.int4_dir, d)
    (d / SHARD2).unlink()
    doc = json.loads((d / INDEX_NAME).read_text())
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if v != SHARD2}
    (d / INDEX_NAME).write_text(json.dumps(doc))
    return d


def test_the_verifier_compares_the_output_with_the_inputs_indexes(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    short = shrunk_int4(pair, tmp_path)
    out = tmp_path / "out"
    assert merge(pair, out, int4=short).returncode == 0
    lost = set(read_header(pair.int4_dir / SHARD2).tensors)
    assert ck.verify_checkpoint(out, expect_mtp=True, expect_hybrid=True).ok  # consistent in itself
    report = ck.verify_checkpoint(out, expect_mtp=True, expect_hybrid=True, int4_source=pair.int4_dir,
                                  fp8_source=pair.fp8_dir)
    assert not report.ok
    assert any(f"{len(lost)} tensors of the INT4 checkpoint" in p and "missing" in p for p in report.problems)
    assert ck.verify_checkpoint(out, expect_mtp=True, int4_source=short, fp8_source=pair.fp8_dir).ok
    verify = [sys.executable, str(SCRIPTS / "verify_checkpoint.py"), str(out), "--expect-mtp",
              "--expect-hybrid"]
    r = subprocess.run([*verify, "--int4-source", str(pair.int4_dir), "--fp8-source", str(pair.fp8_dir)],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 1 and "missing" in r.stdout and "ok (" not in r.stdout
    # an FP8 weight the FP8 checkpoint does not hold (or holds in another shape) is named too
    full = generate(tmp_path / "other", CFG)
    taken = full.expected_taken[0]
    doc = json.loads((out / INDEX_NAME).read_text())
    assert doc["weight_map"][taken]
    shutil.rmtree(full.fp8_dir)
    full.fp8_dir.mkdir()
    r = subprocess.run([*verify, "--int4-source", str(short), "--fp8-source", str(full.fp8_dir)],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 1 and "FP8 source" in r.stdout


def test_the_verifier_refuses_an_int4_source_that_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    r = subprocess.run([sys.executable, str(SCRIPTS / "verify_checkpoint.py"), str(tmp_path / "m"),
                        "--int4-source", str(tmp_path / "nope")], capture_output=True, text=True,
                       env=ENV)
    assert r.returncode == 2 and "--int4-source" in one_line(r)


def test_a_kill_between_the_renames_then_a_failing_rerun_keeps_the_output(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert merge(pair, out).returncode == 0
    # the state a SIGKILL leaves between `out -> out.old-PID` and `out.tmp-PID -> out` (both complete)
    tmp = tmp_path / "out.tmp-999999991"
    shutil.copytree(out, tmp)
    os.replace(out, tmp_path / "out.old-999999991")
    (pair.int4_dir / SHARD2).unlink()  # then the rerun fails on a bad input
    r = merge(pair, out)
    assert r.returncode == 1 and SHARD2 in one_line(r)
    assert out.is_dir(), "the complete new output must be restored, not deleted"
    assert ck.verify_checkpoint(out, expect_mtp=True, expect_hybrid=True).ok
    assert json.loads((out / MARKER).read_text())["tool"] == "hybrid_merge"


def test_a_complete_old_output_is_restored_when_only_it_is_left(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert merge(pair, out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    os.replace(out, tmp_path / "out.old-999999992")  # killed after the first rename; the temp was lost
    partial = tmp_path / "out.tmp-999999993"  # an interrupted temp: not complete, removed
    partial.mkdir()
    (partial / MARKER).write_text('{"tool": "hybrid_merge"}')
    r = merge(pair, out)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["changed"] is False  # the restored output is current: nothing merged
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not partial.exists() and not (tmp_path / "out.old-999999992").exists()


def test_too_little_free_space_is_refused_first_with_the_sizes(
    pair: GeneratedPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "out"
    assert main(pair, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    os.utime(pair.int4_dir / "tokenizer.json", ns=(1, 1))  # inputs changed: a new merge is needed
    monkeypatch.setattr(hybrid_merge, "free_bytes", lambda _path: 1000)
    assert main(pair, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert str(out) in err[0] and "1000 bytes free" in err[0] and "needs" in err[0] and "free space" in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob("out.tmp-*")) and not list(tmp_path.glob(".out.*"))


def test_a_full_disk_during_the_write_names_the_path_the_sizes_and_the_fix(
    pair: GeneratedPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "out"
    real = hybrid_merge.copy_ranges
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(hybrid_merge, "copy_ranges", failing)
    assert main(pair, out) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert str(hybrid_merge.parts_dir(out)) in err[0] and "No space left on device" in err[0]
    assert "bytes free" in err[0] and "needs" in err[0] and "free space" in err[0]
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


def test_a_second_merge_into_the_same_out_is_refused_naming_the_first(
    pair: GeneratedPair, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    lock = hybrid_merge.lock_path(out)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        rc = main(pair, out)
    finally:
        os.close(fd)
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"another merge is writing {out} (pid {os.getpid()})" in err[0]
    assert not out.exists()
    lock.unlink()
    assert main(pair, out) == 0
    assert not lock.exists()  # a merge removes its lock file when it ends


def main(pair: GeneratedPair, out: Path) -> int:
    return hybrid_merge.main(["--int4", str(pair.int4_dir), "--fp8", str(pair.fp8_dir), "--out", str(out)])


def set_dtype(shard: Path, name: str, dtype: str) -> None:
    """Rewrite one tensor's dtype in a safetensors header (same item size, data untouched)."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8:8 + n])
    doc[name]["dtype"] = dtype
    head = json.dumps(doc).encode()
    head += b" " * (-len(head) % 8)
    shard.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def test_fp8_weights_of_another_type_are_refused_naming_the_tensor(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    name = pair.expected_taken[3]
    fidx = json.loads((pair.fp8_dir / INDEX_NAME).read_text())
    set_dtype(pair.fp8_dir / fidx["weight_map"][name], name, "F8_E5M2")
    out = tmp_path / "out"
    r = merge(pair, out)
    assert r.returncode == 1
    line = one_line(r)
    assert name in line and "F8_E5M2" in line and "F8_E4M3" in line
    assert nothing_written(tmp_path, out)
