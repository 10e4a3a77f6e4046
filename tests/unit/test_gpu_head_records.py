"""tests/gpu/head_records.py without a GPU: the tiny pair with a padded, wider head; the timing proxy against
the stand-in server and the real runner; the runner-vs-proxy comparison; the records-protocol check; the
INT8 head's tile lines read from the format strings of patches/src/sparkllm_lm_head_int8.py; the make
target."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from sparkllm.bench import client as bench_client
from sparkllm.bench import records as bench_records
from sparkllm.bench import runner as bench_runner
from sparkllm.bench.prompts import load_prompts
from sparkllm.checkpoint.safetensors_io import read_header, read_tensor_bytes

from tests.fixtures.standin_server import Config, StandinServer

ROOT = Path(__file__).resolve().parents[2]
hr = pytest.importorskip("tests.gpu.head_records")  # imports e2e (yaml, numpy): both in the test venv
import make_run  # noqa: E402

from tests.gpu import tiny_pair as tp  # noqa: E402

MODULE = (ROOT / "patches" / "src" / "sparkllm_lm_head_int8.py").read_text()


def bf16(path: Path, name: str) -> np.ndarray:
    info = read_header(path).tensors[name]
    u = np.frombuffer(read_tensor_bytes(path, name), "<u2").astype(np.uint32) << 16
    return u.view(np.float32).reshape(info.shape)


# ------------------------------------------------------------------ the padded, wider tiny pair
@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict:
    return tp.generate(tmp_path_factory.mktemp("wide") / "pair", hidden=384, rows=1000)


def test_wide_pair_has_the_asked_head_and_restores_the_defaults(wide):
    d = Path(wide["int4"])
    f = d / "model-00001-of-00002.safetensors"
    tensors = read_header(f).tensors
    assert list(tensors["lm_head.weight"].shape) == [1000, 384]
    assert list(tensors[tp.LM + "embed_tokens.weight"].shape) == [1000, 384]
    cfg = json.loads((d / "config.json").read_text())["text_config"]
    assert (cfg["vocab_size"], cfg["hidden_size"]) == (1000, 384)
    vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) + len(tp.SPECIALS) == wide["tokenizer_tokens"] < 1000  # padding rows past the ids
    # a later default pair is the tested one: the module's shape is back
    assert (tp.H, tp.head_rows(), tp.vocab_size()) == (256, 320, 320)
    fp8 = Path(wide["fp8"]) / "model-00001-of-00002.safetensors"
    assert np.array_equal(bf16(f, "lm_head.weight"), bf16(fp8, "lm_head.weight"))  # same padding both sides


def test_wide_head_still_follows_the_successor_map_over_its_padding(wide):
    """The trunk's last hidden state is (nearly) the normed embedding of the last token: the head must pick
    its successor with the padding rows' logits far below (they are never to be generated)."""
    f = Path(wide["int4"]) / "model-00001-of-00002.safetensors"
    head, emb = bf16(f, "lm_head.weight"), bf16(f, tp.LM + "embed_tokens.weight")
    n = tp.vocab_size()
    assert not emb[n:].any() and head[n:].any()
    pad_logit_std = head[n:].std() * np.sqrt(384)
    assert abs(pad_logit_std - tp.PAD_LOGIT_STD) < 0.05
    succ = tp.successor_map(np.random.default_rng(0))
    for t in tp.PRINTABLE:
        h = emb[t] / np.sqrt((emb[t] ** 2).mean())
        logits = head @ h
        assert logits.argmax() == succ[t]
        assert logits[succ[t]] > 4.0 > 2.5 > logits[n:].max()


def test_wide_noise_is_scaled_by_fan_in():
    a = tp.Source(0)
    saved = tp.H
    try:
        tp.H = 1024
        b = tp.Source(0)
    finally:
        tp.H = saved
    gate = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight"  # fan-in H
    down = "model.language_model.layers.0.mlp.experts.0.down_proj.weight"  # fan-in 128
    assert b.trunk[gate].std() == pytest.approx(a.trunk[gate].std() / 2, rel=0.05)
    assert b.trunk[down].std() == pytest.approx(a.trunk[down].std(), rel=0.05)


@pytest.mark.parametrize("args", [["--hidden", "300"], ["--head-rows", "100"],
                                  ["--hidden", "512", "--shared-experts-matter"]])
def test_tiny_pair_refuses_a_shape_it_cannot_build(tmp_path, args):
    r = subprocess.run([sys.executable, str(ROOT / "tests/gpu/tiny_pair.py"), str(tmp_path / "x"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "tiny_pair.py:" in r.stderr and not (tmp_path / "x").exists()


# ------------------------------------------------------------------ the proxy
def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, {}


def test_proxy_forwards_and_logs_each_post_inside_the_clients_interval():
    cfg = Config(model="qwen", step_time=0.001)
    with StandinServer(cfg) as srv, hr.TimingProxy(srv.base_url) as proxy:
        t0 = time.monotonic()
        status, doc = post(proxy.url, {"model": "qwen", "max_tokens": 7, "stream": False,
                                       "messages": [{"role": "user", "content": "hi"}]})
        t1 = time.monotonic()
        assert status == 200 and doc["usage"]["completion_tokens"] == 7
        post(proxy.url, {"model": "qwen", "max_tokens": 5, "chat_template_kwargs": {"enable_thinking": True},
                         "messages": [{"role": "user", "content": "hi"}]})
        with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
            assert b"vllm:generation_tokens_total" in r.read()
        with pytest.raises(urllib.error.HTTPError) as e404:
            urllib.request.urlopen(proxy.url + "/v1/completions", timeout=10)
        assert e404.value.code == 404
    first, second = proxy.entries
    assert t0 <= first["received"] < first["finished"] <= t1
    assert first["seconds"] == first["finished"] - first["received"]
    assert (first["status"], first["completion_tokens"], first["stream"], first["max_tokens"],
            first["thinking_kwarg"]) == (200, 7, False, 7, False)
    assert (second["completion_tokens"], second["thinking_kwarg"]) == (5, True)
    assert proxy.gets == {"/metrics": 1}


def test_proxy_reports_a_dead_upstream_as_502():
    with hr.TimingProxy("http://127.0.0.1:9") as proxy:
        status, _ = post(proxy.url, {"model": "m", "messages": []})
    assert status == 502
    assert proxy.entries[0]["status"] == 502 and proxy.entries[0]["completion_tokens"] is None


def test_the_records_runner_through_the_proxy(tmp_path):
    """The real runner, records profile, through the proxy to the stand-in: the protocol is seen on the
    wire, every measured request pairs with a proxy POST with the same tokens, and the runner's tok/s is
    never above the proxy's (its interval contains the proxy's: an ordering, not a speed)."""
    cfg = Config(model="qwen", spec=True, method="mtp", k=2, step_time=0.001, prefill_time=0.005)
    prompts, _ = load_prompts(bench_records.RECORDS_PROMPTS, "qa,math")
    with StandinServer(cfg) as srv, hr.TimingProxy(srv.base_url) as proxy:
        doc = bench_runner.execute_run(bench_runner.RunOptions(
            base_url=proxy.url, model="qwen", label="records-int8", out=tmp_path / "out",
            prompts=bench_records.RECORDS_PROMPTS, category="qa,math", repeats=2, profile="records",
            warmup_pass=True, sampling=bench_client.Sampling(max_tokens=64, thinking="default", stream=False),
            sample_interval=0.05, progress=False))
    assert doc["valid"], doc["problems"]
    assert len(proxy.entries) == 6  # the discarded first pass, then two measured ones
    limits = {p.id: p.max_tokens for p in prompts}
    proto = hr.protocol_followed(proxy.entries, limits, [p.id for p in prompts])
    assert proto["ok"], proto
    m = hr.match_records(doc["requests"], proxy.entries, e2e_tol=1.0)
    assert m["ok"] and m["tokens_equal"] and m["never_above"], m
    assert [p["tokens_proxy"] for p in m["pairs"]] == [r["output_tokens"] for r in doc["requests"]]


# ------------------------------------------------------------------ the comparisons
def rows_entries(runner_s: list[float], proxy_s: list[float], tokens: int = 100, warm: int = 2,
                 repeats: tuple[int, ...] | None = None):
    rows = [{"prompt_id": f"p{i}", "repeat": (repeats or [0] * len(runner_s))[i], "output_tokens": tokens,
             "e2e_s": s, "e2e_tok_s": tokens / s} for i, s in enumerate(runner_s)]
    entries = [{"seconds": 9.0, "completion_tokens": 1}] * warm + [
        {"seconds": s, "completion_tokens": tokens} for s in proxy_s]
    return rows, entries


def test_match_records_pairs_the_last_posts_and_holds_the_bounds():
    rows, entries = rows_entries([1.01, 2.0], [1.0, 1.99])
    m = hr.match_records(rows, entries)
    assert m["ok"] and m["ratio_max"] <= 1 and m["ratio_min"] == pytest.approx(1 / 1.01)
    assert m["proxy_mean"] == pytest.approx((100 / 1.0 + 100 / 1.99) / 2)


@pytest.mark.parametrize(("runner_s", "proxy_s", "tokens_proxy", "failed"), [
    ([0.99], [1.0], 100, "never_above"),  # the runner timed less than the proxy saw: impossible
    ([1.05], [1.0], 100, "within_tol"),  # 5 % slower than the proxy: more than loopback overhead
    ([1.0], [1.0], 99, "tokens_equal"),
])
def test_match_records_fails(runner_s, proxy_s, tokens_proxy, failed):
    rows, entries = rows_entries(runner_s, proxy_s)
    entries[-1]["completion_tokens"] = tokens_proxy
    m = hr.match_records(rows, entries)
    assert not m["ok"] and not m[failed]


def test_match_records_needs_a_post_per_request_and_means_over_passes():
    rows, entries = rows_entries([1.0, 1.0], [1.0], warm=0)
    assert hr.match_records(rows, entries)["ok"] is False
    rows, entries = rows_entries([1.0, 2.0, 4.0], [1.0, 2.0, 4.0], repeats=(0, 0, 1))
    assert hr.match_records(rows, entries)["proxy_mean"] == pytest.approx(((100 + 50) / 2 + 25) / 2)


def test_mean_agrees():
    assert hr.mean_agrees(104.0, 100.0)["ok"] and not hr.mean_agrees(106.0, 100.0)["ok"]
    assert not hr.mean_agrees(None, 100.0)["ok"]


def test_protocol_followed_reads_the_wire():
    prompts, _ = load_prompts(bench_records.RECORDS_PROMPTS)
    limits, ids = {p.id: p.max_tokens for p in prompts}, [p.id for p in prompts]
    good = [{"stream": False, "thinking_kwarg": False, "max_tokens": limits[i]} for i in ids] * 2
    assert hr.protocol_followed(good, limits, ids)["ok"]
    assert hr.protocol_followed(good[::-1], limits, ids)["ok"]  # passes ordered by category
    for bad in ({"stream": True}, {"thinking_kwarg": True}, {"max_tokens": 256}):
        entries = [dict(e) for e in good]
        entries[3].update(bad)  # records-math asks 64
        assert not hr.protocol_followed(entries, limits, ids)["ok"], bad
    assert not hr.protocol_followed(good[:-1], limits, ids)["ok"]
    assert not hr.protocol_followed([], limits, ids)["ok"]


# ------------------------------------------------------------------ the INT8 head's log lines
def formats(prefix: str) -> list[str]:
    return re.findall(r'"(' + re.escape(prefix) + r'[^"]*)"', MODULE)


def test_tile_lines_in_the_modules_own_formats_are_read():
    # the module's tile description (_describe of Tile.__str__), checked against its source
    assert 'f"M<={b}: {t}"' in MODULE
    assert 'f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.warps}/s{self.stages}"' in MODULE
    desc = "M<=1: 16x64x256/w4/s3, M<=256: 128x256x64/w8/s3"
    lines = []
    for f in formats("sparkllm: lm_head INT8 tiles for "):
        if "autotuned" in f:
            lines.append(f % (248320, 3072, "NVIDIA H200", desc, 12.34, "cached in /w/t.json"))
        elif "from cache" in f:
            lines.append(f % (248320, 3072, "NVIDIA H200", desc, "/w/t.json"))
        elif "fixed table" in f:
            lines.append(f % (248320, 3072, "SPARKLLM_LM_HEAD_INT8_TUNE", desc))
    assert len(lines) == 3, lines
    (fail,) = formats("sparkllm: lm_head INT8 tile autotune failed")
    text = "\n".join(f"INFO 12-05 [sparkllm_lm_head_int8.py:1] {ln}" for ln in lines) + "\n" + (
        fail % ("RuntimeError", "boom"))
    got = hr.head_lines(text)
    assert [t["how"] for t in got["tiles"]] == ["fixed", "cache", "autotuned"]
    assert all((t["rows"], t["cols"]) == (248320, 3072) for t in got["tiles"])
    assert got["tiles"][2]["seconds"] == 12.3 and got["tiles"][1]["seconds"] is None
    assert got["tiles"][2]["tiles"] == {1: "16x64x256/w4/s3", 256: "128x256x64/w8/s3"}
    assert len(got["autotune_failed"]) == 1 and len(got["lines"]) == 4
    assert hr.head_lines("nothing here") == {"lines": [], "tiles": [], "autotune_failed": []}


def test_the_env_names_are_the_modules():
    assert f'TUNE_DIR_ENV = "{hr.TUNE_DIR_ENV}"' in MODULE
    assert 'ENV = "SPARKLLM_LM_HEAD_INT8"' in MODULE


def test_decode_figure():
    doc = {"valid": True, "problems": [], "summary": {"requests": 20, "decode_tok_s": {"median": 101.5}},
           "spec": {"acceptance_rate": 0.98, "mean_acceptance_length": 2.96}}
    assert hr.decode_figure(doc)["decode_tok_s_median"] == 101.5
    assert hr.decode_figure({"summary": {}})["decode_tok_s_median"] is None


# ------------------------------------------------------------------ command line and make
def test_help_and_usage_errors(tmp_path):
    script = str(ROOT / "tests/gpu/head_records.py")
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--budget" in r.stdout and "--records-category" in r.stdout
    for bad in (["--records-category", "nope"], ["--budget", "50"], []):
        r = subprocess.run([sys.executable, script, "--out", str(tmp_path / "o"), *bad][: None if bad else 2],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (bad, r.stderr)
        assert not (tmp_path / "o" / "summary.json").exists()


def test_make_target_runs_the_script_through_make_run():
    argv = make_run.build_argv("gpu-head-records", {"ARGS": "--budget 500"})
    assert argv == [sys.executable, "tests/gpu/head_records.py", "--out", "results/gpu-head-records",
                    "--budget", "500"]
    r = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), "gpu-head-records"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "scripts/make_run.py gpu-head-records" in r.stdout


def test_proxy_closes_its_port():
    with hr.TimingProxy("http://127.0.0.1:9") as proxy:
        port = proxy.server.server_address[1]
    with pytest.raises(OSError):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("GET", "/metrics")
        c.getresponse()


def test_record_closing_stops_the_servers_and_keeps_the_failure(tmp_path):
    class Stub:
        stopped = 0

        def stop(self) -> None:
            self.stopped += 1

    rec = hr.e2e.Record(tmp_path / "out", tmp_path / "work", log_fn=lambda msg: None, figures={})
    servers = {"a": Stub(), "b": Stub()}
    with pytest.raises(KeyError), rec.closing(servers):
        rec.summary["figures"]["x"] = 1
        raise KeyError("lost")
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [s.stopped for s in servers.values()] == [1, 1]
    assert saved["figures"] == {"x": 1} and saved["failed"] == ["run finished without an exception"]
