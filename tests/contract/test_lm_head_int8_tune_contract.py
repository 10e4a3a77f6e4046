"""The load-time tile autotune of patches/src/sparkllm_lm_head_int8.py (issue 44), its pure parts on the CPU.

The module imports torch and vLLM, so it is loaded here under .venv-vllm (marker ``vllm_contract``, like
test_lm_head_int8_patch_contract.py). What a GPU alone can show (the CUDA-event timings, the tiles chosen on
a GB10 or an H200) is tests/gpu/bench_lm_head.py's. Covered here: the bucket of a step, the candidates of a
bucket, the choice from given timings, the cache key, the cache round trip, a corrupt or unwritable cache
ignored, the off switch, the orchestration of tune_tiles (timing stubbed, CUDA device properties faked) and,
under Triton's interpreter, that a chosen tile reaches the kernel and gives the fixed tile's logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "patches" / "src" / "sparkllm_lm_head_int8.py"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("sparkllm_lm_head_int8_under_test", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Log:
    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def _add(self, level, msg, *args):
        self.lines.append((level, msg % args if args else msg))

    def info(self, msg, *args):
        self._add("info", msg, *args)

    def warning(self, msg, *args):
        self._add("warning", msg, *args)

    def debug(self, msg, *args):
        self._add("debug", msg, *args)


@pytest.fixture
def log(mod, monkeypatch):
    stub = Log()
    monkeypatch.setattr(mod, "logger", stub)
    monkeypatch.setattr(mod, "_TUNED", {})
    for name in (mod.TUNE_ENV, mod.TUNE_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    return stub


def test_buckets_cover_every_step_size(mod):
    assert list(mod.TUNE_BUCKETS) == sorted(mod.TUNE_BUCKETS) and mod.TUNE_BUCKETS[0] == 1
    assert [mod.bucket_for(m) for m in (1, 2, 3, 5, 16, 17, 33, 65, 200, 256)] == \
        [1, 2, 4, 8, 16, 32, 64, 128, 256, 256]
    assert mod.bucket_for(4096) == mod.TUNE_BUCKETS[-1]  # above the last bucket: its tiles


@pytest.mark.parametrize("bucket", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_each_bucket_times_suitable_candidates_with_the_fixed_tile_among_them(mod, bucket):
    cands = mod.candidates_for(bucket)
    assert len(cands) >= 3 and len(set(cands)) == len(cands)
    assert all(t.block_m >= 16 for t in cands)  # tl.dot's least tile height
    assert all(t.block_m <= max(16, 2 * bucket) for t in cands)  # no tile mostly of masked rows
    # the tune can only match or beat today's table: its tile is a candidate
    assert mod.fixed_tile(bucket) in cands


def test_the_fastest_candidate_is_picked_per_bucket(mod):
    c = mod.candidates_for(1)
    d = mod.candidates_for(64)
    timings = {1: {c[0]: 300.0, c[1]: 210.0, c[2]: None, c[3]: float("nan")},
               64: {d[0]: 500.0, d[1]: 400.0, d[2]: 400.0}}
    chosen = mod.pick_fastest(timings)
    assert set(chosen) == set(mod.TUNE_BUCKETS)
    assert chosen[1] == c[1]
    # a tie goes to the candidate listed first: the same timings always give the same choice
    first = min((d[1], d[2]), key=mod.CANDIDATES.index)
    assert chosen[64] == first
    # nothing timed (all failed, or a bucket not tuned): the fixed table
    assert chosen[8] == mod.fixed_tile(8)
    assert mod.pick_fastest({16: {c[0]: None}})[16] == mod.fixed_tile(16)


def test_the_cache_key_names_device_shape_dtype_compiler_and_candidates(mod, tmp_path):
    base = dict(gpu="NVIDIA GB10", capability=(12, 1), n=248320, k=3072, dtype="torch.bfloat16",
                triton_version="3.6.0")
    key = mod.tune_key(**base)
    assert key["dtype"] == "bfloat16" and key["capability"] == "12.1"
    assert key["candidates"] == [list(t) for t in mod.CANDIDATES]
    path = mod.tune_cache_file(str(tmp_path), key)
    assert path == mod.tune_cache_file(str(tmp_path), mod.tune_key(**base))
    assert Path(path).parent == tmp_path
    for change in (dict(gpu="NVIDIA H200"), dict(capability=(9, 0)), dict(n=151936), dict(k=4096),
                   dict(dtype="torch.float16"), dict(triton_version="3.7.0")):
        assert mod.tune_cache_file(str(tmp_path), mod.tune_key(**{**base, **change})) != path, change


def _key(mod):
    return mod.tune_key("NVIDIA GB10", (12, 1), 248320, 3072, "torch.bfloat16", "3.6.0")


def test_cache_round_trip(mod, log, tmp_path):
    key = _key(mod)
    tiles = {b: mod.candidates_for(b)[-1] for b in mod.TUNE_BUCKETS}
    path = mod.tune_cache_file(str(tmp_path / "new"), key)  # the directory is created
    timings = {1: {tiles[1]: 123.45, mod.fixed_tile(1): None}}
    assert mod.save_tune_cache(path, key, tiles, timings) is True
    assert mod.load_tune_cache(path, key) == tiles
    doc = json.loads(Path(path).read_text())
    assert doc["key"] == key and doc["timings_us"]["1"] == {str(tiles[1]): 123.5}
    assert os.listdir(Path(path).parent) == [Path(path).name]  # no temporary left beside it
    assert mod.load_tune_cache(str(tmp_path / "absent.json"), key) is None
    assert log.lines == []  # a missing file is a plain miss, not a warning


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"tiles": {}}),
    json.dumps({"key": "other", "tiles": {}}),
    "CHANGED_KEY",
    "MISSING_BUCKET",
    "FOREIGN_TILE",
    json.dumps([1, 2, 3]),
])
def test_a_corrupt_or_foreign_cache_is_ignored_with_a_warning(mod, log, tmp_path, content):
    key = _key(mod)
    good = {str(b): list(mod.fixed_tile(b)) for b in mod.TUNE_BUCKETS}
    if content == "CHANGED_KEY":
        content = json.dumps({"key": {**key, "gpu": "NVIDIA H200"}, "tiles": good})
    elif content == "MISSING_BUCKET":
        content = json.dumps({"key": key, "tiles": {b: t for b, t in good.items() if b != "256"}})
    elif content == "FOREIGN_TILE":
        content = json.dumps({"key": key, "tiles": {**good, "1": [16, 16, 16, 1, 1]}})
    path = tmp_path / "tiles.json"
    path.write_text(content)
    assert mod.load_tune_cache(str(path), key) is None
    assert [lvl for lvl, _ in log.lines] == ["warning"] and str(path) in log.lines[0][1]


def test_an_unwritable_cache_is_logged_and_ignored(mod, log, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = str(blocker / "sub" / "tiles.json")  # its parent cannot be a directory
    assert mod.save_tune_cache(path, _key(mod), {1: mod.fixed_tile(1)}, {}) is False
    assert [lvl for lvl, _ in log.lines] == ["warning"] and "not written" in log.lines[0][1]


@pytest.mark.parametrize("raw,want,warned", [(None, True, False), ("", True, False), ("1", True, False),
                                             ("on", True, False), ("0", False, False), ("off", False, False),
                                             ("maybe", False, True)])
def test_the_off_switch(mod, log, monkeypatch, raw, want, warned):
    if raw is not None:
        monkeypatch.setenv(mod.TUNE_ENV, raw)
    assert mod.tune_enabled() is want
    assert bool(log.lines) is warned


# --- tune_tiles: cache, timing, fallbacks (CUDA faked: the timing is stubbed) ---------------------------

@pytest.fixture
def fake_cuda(mod, monkeypatch):
    import torch

    props = types.SimpleNamespace(name="NVIDIA GB10", major=12, minor=1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    calls = []
    fast = {b: mod.candidates_for(b)[-1] for b in mod.TUNE_BUCKETS}

    def autotune(q, scale, dtype):
        calls.append(tuple(q.shape))
        return {b: {mod.fixed_tile(b): 200.0, fast[b]: 100.0} for b in mod.TUNE_BUCKETS}

    monkeypatch.setattr(mod, "autotune", autotune)
    q = types.SimpleNamespace(shape=(248320, 3072), device=torch.device("cuda", 0))
    return types.SimpleNamespace(q=q, calls=calls, fast=fast, dtype=torch.bfloat16)


def test_tune_tiles_times_once_caches_then_hits_the_cache(mod, log, fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setenv(mod.TUNE_DIR_ENV, str(tmp_path))
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    assert fake_cuda.calls == [(248320, 3072)]
    (cache,) = tmp_path.iterdir()
    info = [m for lvl, m in log.lines if lvl == "info"]
    assert len(info) == 1 and "autotuned in" in info[0] and f"cached in {cache}" in info[0]
    assert "M<=1: " + str(fake_cuda.fast[1]) in info[0]
    # in-process: the same shape again (a drafter's own head) is not timed again
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    assert len(fake_cuda.calls) == 1
    # a new process (the table empty): from the cache, no timing
    monkeypatch.setattr(mod, "_TUNED", {})
    log.lines.clear()
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    assert len(fake_cuda.calls) == 1
    assert log.lines == [("info", log.lines[0][1])] and f"from cache {cache}" in log.lines[0][1]
    assert mod.tile_for(3, 248320, 3072, fake_cuda.dtype, fake_cuda.q.device) == fake_cuda.fast[4]
    assert mod.tile_for(3, 248320, 3072, fake_cuda.dtype, fake_cuda.q.device) != mod.fixed_tile(3)


def test_tune_tiles_with_a_corrupt_cache_tunes_again_and_rewrites_it(mod, log, fake_cuda, monkeypatch,
                                                                     tmp_path):
    monkeypatch.setenv(mod.TUNE_DIR_ENV, str(tmp_path))
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    (cache,) = tmp_path.iterdir()
    cache.write_text("garbage")
    monkeypatch.setattr(mod, "_TUNED", {})
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    assert len(fake_cuda.calls) == 2
    assert json.loads(cache.read_text())["tiles"]["1"] == list(fake_cuda.fast[1])


def test_tune_tiles_without_a_cache_dir_or_with_an_unwritable_one_still_tunes(mod, log, fake_cuda,
                                                                              monkeypatch, tmp_path):
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    assert len(fake_cuda.calls) == 1 and f"{mod.TUNE_DIR_ENV} unset" in log.lines[-1][1]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(mod.TUNE_DIR_ENV, str(blocker))
    monkeypatch.setattr(mod, "_TUNED", {})
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    assert len(fake_cuda.calls) == 2
    assert mod.tile_for(1, 248320, 3072, fake_cuda.dtype, fake_cuda.q.device) == fake_cuda.fast[1]
    assert "not cached" in log.lines[-1][1]


def test_the_off_switch_keeps_the_fixed_table_without_timing(mod, log, fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setenv(mod.TUNE_ENV, "0")
    monkeypatch.setenv(mod.TUNE_DIR_ENV, str(tmp_path))
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    assert fake_cuda.calls == [] and list(tmp_path.iterdir()) == []
    assert "fixed table" in log.lines[-1][1]
    for m in (1, 20, 48, 100):
        assert mod.tile_for(m, 248320, 3072, fake_cuda.dtype, fake_cuda.q.device) == mod.fixed_tile(m)


def test_a_failing_autotune_falls_back_to_the_fixed_table(mod, log, fake_cuda, monkeypatch):
    def broken(q, scale, dtype):
        raise RuntimeError("no CUDA events here")

    monkeypatch.setattr(mod, "autotune", broken)
    mod.tune_tiles(fake_cuda.q, None, fake_cuda.dtype)
    assert log.lines[-1][0] == "warning" and "fixed table" in log.lines[-1][1]
    assert mod.tile_for(1, 248320, 3072, fake_cuda.dtype, fake_cuda.q.device) == mod.fixed_tile(1)


def test_a_cpu_head_is_never_tuned(mod, log):
    import torch

    q = torch.zeros(8, 4, dtype=torch.int8)
    mod.tune_tiles(q, torch.ones(8), torch.bfloat16)
    assert mod._TUNED == {} and log.lines == []


_INTERPRETED = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("m", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
g = torch.Generator().manual_seed(0)
w = torch.randn(200, 96, generator=g) * 0.02
q, s, _, _ = mod.quantize_per_row(w)
x = torch.randn(3, 96, generator=g).to(torch.bfloat16)
ref = mod._triton_logits(x, q, s, mod.fixed_tile(3)).float()
out = {str(t): float((mod._triton_logits(x, q, s, t).float() - ref).abs().max())
       for t in mod.candidates_for(4)[:3]}
print("TILES " + json.dumps({"max_abs_logit": float(ref.abs().max()), "diff": out}))
"""


def test_a_chosen_tile_reaches_the_kernel_under_the_interpreter(mod):
    """Triton's interpreter on the CPU runs the same kernel with other tiles: the logits agree with the
    fixed tile's (the tile's launch parameters reach the kernel and the masks hold at any tile size)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, str(SOURCE)], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TILES ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1].split(" ", 1)[1])
    assert got["max_abs_logit"] > 0 and len(got["diff"]) == 3
    assert all(d <= 1e-2 * got["max_abs_logit"] for d in got["diff"].values()), got
