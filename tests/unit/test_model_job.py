"""model_job.py and hybrid_merge's parts: shards merged as they land, resume shard by shard, failures
stop the whole job, the token reaches the fetches only through their environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fetch_checkpoint as fc
import hybrid_merge
import model_job
import pytest
from sparkllm.checkpoint import hybrid as ck

from tests.fixtures.make_checkpoints import GenConfig, GeneratedPair, generate

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CFG = GenConfig(layers=4, experts=4)
EXTRA = "model_extra_tensors.safetensors"


@pytest.fixture
def mirror(tmp_path: Path) -> GeneratedPair:
    pair = generate(tmp_path / "mirror", CFG)
    for d in (pair.int4_dir, pair.fp8_dir):
        fc.write_manifest(d, with_sha256=True)
    return pair


def fetch_argv(src: Path, dest: Path, rate: float = 0) -> list[str]:
    tool = str(SCRIPTS / "fetch_checkpoint.py")
    argv = [sys.executable, tool, "mirror", "--src", str(src), "--dest", str(dest)]
    return argv + (["--max-rate", str(rate)] if rate else [])


def int4_bytes(pair: GeneratedPair) -> int:
    return sum(p.stat().st_size for p in pair.int4_dir.iterdir() if p.is_file())


def write_spec(tmp_path: Path, fetches: list[dict], **extra: str) -> Path:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "fetches": fetches, "int4_dir": str(tmp_path / "int4"), "fp8_dir": str(tmp_path / "fp8"),
        "merge_out": str(tmp_path / "model.staging"), **extra,
    }))
    return spec


def run_job(tmp_path: Path, spec: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    res = subprocess.run(
        [sys.executable, str(SCRIPTS / "model_job.py"), "--spec", str(spec), "--status",
         str(tmp_path / "status.json"), "--log", str(tmp_path / "job.log")],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )
    return res, json.loads((tmp_path / "status.json").read_text())


def test_each_shard_is_merged_while_the_rest_still_downloads(mirror: GeneratedPair, tmp_path: Path) -> None:
    rate = int4_bytes(mirror) / 6  # the INT4 copy takes about 6 s
    spec = write_spec(tmp_path, [
        {"key": "int4", "argv": fetch_argv(mirror.int4_dir, tmp_path / "int4", rate)},
        {"key": "fp8", "argv": fetch_argv(mirror.fp8_dir, tmp_path / "fp8")},
    ])
    res, status = run_job(tmp_path, spec)
    assert res.returncode == 0, res.stderr + (tmp_path / "job.log").read_text()
    assert status["state"] == "done"
    shards = sorted(p.name for p in mirror.int4_dir.glob("*.safetensors"))
    assert sorted(status["merged"]) == shards
    int4_end = status["fetches"]["int4"]["ended"]
    first = min(status["merged"].values())
    assert first < int4_end - 1.5, "the first shard must be merged well before the last byte"
    assert status["last_merge"] - status["last_byte"] < 2.0
    # the job assembled and verified the hybrid from the parts (linked, nothing written again) at once
    assert status["ready"] is not None and status["ready"] - status["last_byte"] < 2.0
    assert f"({len(shards)} merged shard(s) linked)" in status["assembly"]
    out = tmp_path / "model.staging"
    assert not hybrid_merge.parts_dir(out).exists()
    report = ck.verify_checkpoint(out, expect_mtp=True, expect_hybrid=True)
    assert report.ok, report.problems
    # the manifests the model stage writes next to the inputs afterwards leave that merge current
    for d in ("int4", "fp8"):
        fc.write_manifest(tmp_path / d, with_sha256=False)
    result, _ = hybrid_merge.run(tmp_path / "int4", tmp_path / "fp8", out)
    assert result is not None and not result.changed


def test_without_the_mtp_file_the_job_leaves_the_assembly_to_the_model_stage(
    mirror: GeneratedPair, tmp_path: Path
) -> None:
    (mirror.int4_dir / EXTRA).unlink()
    fc.write_manifest(mirror.int4_dir, with_sha256=True)
    spec = write_spec(tmp_path, [
        {"key": "int4", "argv": fetch_argv(mirror.int4_dir, tmp_path / "int4")},
        {"key": "fp8", "argv": fetch_argv(mirror.fp8_dir, tmp_path / "fp8")},
    ])
    res, status = run_job(tmp_path, spec)
    assert res.returncode == 0, res.stderr
    assert status["ready"] is None and EXTRA in status["assembly"]
    assert not (tmp_path / "model.staging").exists()


def test_parts_match_a_merge_from_scratch_byte_for_byte(mirror: GeneratedPair, tmp_path: Path) -> None:
    ahead, scratch = tmp_path / "ahead", tmp_path / "scratch"
    fp8 = ck.load_fp8_table(mirror.fp8_dir)
    for shard in sorted(mirror.int4_dir.glob("*.safetensors")):
        assert hybrid_merge.merge_landed_shard(shard, fp8, ahead) is True
    hybrid_merge.run(mirror.int4_dir, mirror.fp8_dir, ahead)
    hybrid_merge.run(mirror.int4_dir, mirror.fp8_dir, scratch)
    for f in sorted(scratch.glob("*.safetensors")):
        assert (ahead / f.name).read_bytes() == f.read_bytes(), f.name
    index = "model.safetensors.index.json"
    assert (ahead / index).read_text() == (scratch / index).read_text()


def test_an_interrupted_merge_resumes_only_the_missing_or_changed_shards(
    mirror: GeneratedPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    shards = sorted(mirror.int4_dir.glob("model-*.safetensors"))
    calls: list[str] = []
    real = hybrid_merge.write_shard

    def crash_on_third(shard, path):  # noqa: ANN001, ANN202
        calls.append(shard.name)
        if len(calls) == 3:
            raise OSError("disk unplugged")
        return real(shard, path)

    monkeypatch.setattr(hybrid_merge, "write_shard", crash_on_third)
    with pytest.raises(OSError):
        hybrid_merge.run(mirror.int4_dir, mirror.fp8_dir, out)
    assert not out.exists()
    done = json.loads((hybrid_merge.parts_dir(out) / hybrid_merge.PARTS_RECORD).read_text())
    assert sorted(done) == [s.name for s in shards[:2]]
    assert not list(hybrid_merge.parts_dir(out).glob(".*.part-*"))  # the cut write left nothing

    calls.clear()
    monkeypatch.setattr(hybrid_merge, "write_shard", real)
    os.utime(shards[0], ns=(time.time_ns(), time.time_ns()))  # an input refetched since
    written: list[str] = []
    monkeypatch.setattr(hybrid_merge, "write_shard", lambda s, p: written.append(s.name) or real(s, p))
    result, _ = hybrid_merge.run(mirror.int4_dir, mirror.fp8_dir, out)
    assert result is not None
    expected = sorted({shards[0].name, *[s.name for s in shards[2:]], EXTRA})
    assert sorted(written) == expected  # shard 2 reused; shard 1 redone (input changed); the rest new
    assert result.timings["shards_reused"] == 1
    assert ck.verify_checkpoint(out, expect_mtp=True, expect_hybrid=True).ok


def test_a_failed_fetch_stops_the_other_and_fails_the_job(mirror: GeneratedPair, tmp_path: Path) -> None:
    bad = tmp_path / "bad-fp8"
    subprocess.run(["cp", "-a", str(mirror.fp8_dir), str(bad)], check=True)
    target = next(bad.glob("*.safetensors"))
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size - 10)
    slow = int4_bytes(mirror) / 60  # would take a minute
    spec = write_spec(tmp_path, [
        {"key": "int4", "argv": fetch_argv(mirror.int4_dir, tmp_path / "int4", slow)},
        {"key": "fp8", "argv": fetch_argv(bad, tmp_path / "fp8")},
    ])
    t0 = time.monotonic()
    res, status = run_job(tmp_path, spec)
    assert time.monotonic() - t0 < 30
    assert res.returncode == 1
    assert status["state"] == "failed"
    assert "FP8 fetch failed" in status["error"] and target.name in status["error"]
    assert status["fetches"]["int4"]["rc"] is None  # stopped, not finished
    log = (tmp_path / "job.log").read_text()
    assert "stopping the INT4 fetch" in log


def test_sigterm_stops_the_fetches_and_keeps_what_is_verified(mirror: GeneratedPair, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, [
        {"key": "int4", "argv": fetch_argv(mirror.int4_dir, tmp_path / "int4", int4_bytes(mirror) / 60)},
    ])
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "model_job.py"), "--spec", str(spec), "--status",
         str(tmp_path / "status.json"), "--log", str(tmp_path / "job.log")], env=env,
    )
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 1
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed" and "SIGTERM" in status["error"]
    children = subprocess.run(["pgrep", "-f", str(tmp_path / "int4")], capture_output=True, text=True)
    assert children.stdout.strip() == ""


def test_the_token_reaches_the_fetch_in_its_environment_and_the_file_is_gone(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("hf_secret\n")
    token.chmod(0o600)
    code = "import json, os, sys; print(json.dumps({'token': os.environ.get('HF_TOKEN'), 'argv': sys.argv}))"
    show = [sys.executable, "-c", code]
    (tmp_path / "int4").mkdir()
    (tmp_path / "fp8").mkdir()
    spec = write_spec(tmp_path, [{"key": "fp8", "argv": show, "token": True},
                                 {"key": "int4", "argv": show}], token_file=str(token))
    res, status = run_job(tmp_path, spec)
    assert res.returncode == 0, res.stderr
    assert not token.exists()
    assert status["fetches"]["fp8"]["result"]["token"] == "hf_secret"
    assert status["fetches"]["int4"]["result"]["token"] is None  # only the fetch marked for it
    assert "hf_secret" not in json.dumps(status["fetches"]["fp8"]["result"]["argv"])
    assert "hf_secret" not in (tmp_path / "job.log").read_text()


def test_a_model_served_as_fetched_is_fetched_whole_and_nothing_is_merged(
    mirror: GeneratedPair, tmp_path: Path
) -> None:
    # catalogue assembly none: one checkpoint under the model's own key, no merge directories
    dest = tmp_path / "qwen3.6-35b-a3b-fp8"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"merge": False, "fetches": [
        {"key": "qwen3.6-35b-a3b-fp8", "argv": fetch_argv(mirror.fp8_dir, dest)}]}))
    res, status = run_job(tmp_path, spec)
    assert res.returncode == 0, res.stderr
    assert status["state"] == "done" and status["merged"] == {}
    assert status["fetches"]["qwen3.6-35b-a3b-fp8"]["rc"] == 0
    assert status["assembly"].startswith("none")
    listed = json.loads((mirror.fp8_dir / "sparkllm-manifest.json").read_text())["files"]
    assert sorted(fc.verified_files(dest)) == sorted(f["name"] for f in listed)
    assert not list(tmp_path.glob("*.parts")) and not (tmp_path / "model.staging").exists()
    assert "served as fetched: nothing to merge" in (tmp_path / "job.log").read_text()


@pytest.mark.parametrize("doc", [[], {"fetches": "x", "int4_dir": "a", "fp8_dir": "b", "merge_out": "c"},
                                 {"fetches": [], "int4_dir": "", "fp8_dir": "b", "merge_out": "c"},
                                 # a merge job takes only int4 and fp8; a plain one any name, once each
                                 {"fetches": [{"key": "qwen3.6", "argv": ["x"]}], "int4_dir": "a",
                                  "fp8_dir": "b", "merge_out": "c"},
                                 {"merge": False, "fetches": [{"key": "../x", "argv": ["x"]}]},
                                 {"merge": False,
                                  "fetches": [{"key": "a", "argv": ["x"]}, {"key": "a", "argv": ["y"]}]},
                                 {"merge": "no", "fetches": []}])
def test_a_bad_spec_is_a_usage_error(tmp_path: Path, doc: object, capsys: pytest.CaptureFixture) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    assert model_job.main(["--spec", str(spec), "--status", str(tmp_path / "s.json")]) == 2
    assert "model_job: error:" in capsys.readouterr().err


def test_verified_files_lists_only_files_still_as_verified(mirror: GeneratedPair, tmp_path: Path) -> None:
    dest = tmp_path / "int4"
    fc.mirror_fetch(mirror.int4_dir, dest)
    names = fc.verified_files(dest)
    assert EXTRA in names
    (dest / EXTRA).write_bytes(b"changed")
    assert EXTRA not in fc.verified_files(dest)
