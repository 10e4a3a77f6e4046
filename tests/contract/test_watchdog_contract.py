"""What the ops watchdog (scripts/ops_watchdog.py) and its stand-in rely on, read from vLLM 0.19.1 and 0.26.0.

* the metric names it reads: counters ``vllm:generation_tokens``, ``vllm:prompt_tokens``,
  ``vllm:request_success`` and gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``
  (``vllm/v1/metrics/loggers.py``), exposed by prometheus_client as ``<counter>_total``;
* generation tokens are counted every engine step, not when a request ends: ``record()`` adds
  ``iteration_stats.num_generation_tokens``, which ``IterationStats.update_from_output`` grows by each
  output's new tokens (``vllm/v1/metrics/stats.py``) - so they advance while long requests run;
* ``/health`` is 200 while the engine hangs: the route answers 503 only for ``EngineDeadError`` and
  ``AsyncLLM.check_health`` raises only when ``self.errored`` (no round trip to the engine);
* at ``max_num_seqs`` running requests the scheduler schedules no waiting one (``max_num_running_reqs``);
* the API key guards only ``/v1`` (and in 0.26.0 ``/v2``, ``/inference``): ``/metrics`` and ``/health``
  need none, and a wrong key on ``/v1/completions`` is a 401;
* a chunked prefill moves none of the three counters but ``vllm:kv_cache_usage_perc`` (and
  ``vllm:prefix_cache_queries_total`` when the request is first scheduled): each step returns its
  SchedulerStats even without a request output, ``AsyncLLM`` records them with no IterationStats, and the
  release's own ``KVCacheManager`` + ``PrometheusStatLogger`` (run by ``watchdog_prefill_probe.py``) move
  the gauge at every step whose chunk fills a new block - every step when the chunk is at least a block,
  at least once every ceil(block / chunk) steps otherwise;
* the stand-in (tests/fixtures/standin_server) behaves so: checked against the same facts.
"""

from __future__ import annotations

import ast
import http.client
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import ops_watchdog as wd
import pytest

from tests.fixtures.standin_server.server import Config, StandinServer

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
RELEASES = {
    "0.19.1": ROOT / ".venv-vllm" / "lib" / "python3.11" / "site-packages" / "vllm",
    "0.26.0": ROOT / ".cache" / "vllm-0.26.0-py" / "vllm",
}
KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter"}
AUTH = {"0.19.1": "entrypoints/openai/server_utils.py", "0.26.0": "entrypoints/serve/utils/server_utils.py"}


def _src(release: str, rel: str) -> str:
    path = RELEASES[release] / rel
    if not path.is_file():
        pytest.fail(f"{path} missing; run tests/contract/setup_vllm_env.sh (and link .cache/vllm-0.26.0-py)")
    return path.read_text()


def _metrics(release: str) -> dict[str, str]:
    out = {}
    for node in ast.walk(ast.parse(_src(release, "v1/metrics/loggers.py"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KINDS:
            name = {k.arg: k.value for k in node.keywords}.get("name")
            if isinstance(name, ast.Constant) and str(name.value).startswith("vllm:"):
                out[name.value] = KINDS[node.func.attr]
    return out


def _function(tree: ast.AST, name: str) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"no function {name}")


def _exposed(name: str, kind: str) -> str:
    return name + "_total" if kind == "counter" else name


@pytest.mark.parametrize("release", RELEASES)
def test_the_metrics_the_watchdog_reads_exist_with_their_kind(release):
    real = _metrics(release)
    want = {wd.GENERATED: ("vllm:generation_tokens", "counter"),
            wd.PROMPT: ("vllm:prompt_tokens", "counter"),
            wd.FINISHED: ("vllm:request_success", "counter"),
            wd.RUNNING: ("vllm:num_requests_running", "gauge"),
            wd.WAITING: ("vllm:num_requests_waiting", "gauge")}
    for exposed, (name, kind) in want.items():
        assert real.get(name) == kind, f"{release}: {name} is {real.get(name)!r}, the watchdog needs a {kind}"
        assert _exposed(name, kind) == exposed


@pytest.mark.parametrize("release", RELEASES)
def test_generation_tokens_are_counted_every_engine_step(release):
    tree = ast.parse(_src(release, "v1/metrics/loggers.py"))
    prom = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "PrometheusStatLogger")
    record = ast.unparse(_function(prom, "record"))
    assert re.search(r"self\.counter_generation_tokens\[engine_idx\]\.inc\(\s*iteration_stats\."
                     r"num_generation_tokens\s*\)", record), release
    stats = ast.parse(_src(release, "v1/metrics/stats.py"))
    cls = next(n for n in ast.walk(stats) if isinstance(n, ast.ClassDef) and n.name == "IterationStats")
    upd = ast.unparse(_function(cls, "update_from_output"))
    assert "num_new_generation_tokens = len(output.new_token_ids)" in upd
    assert "self.num_generation_tokens += num_new_generation_tokens" in upd


@pytest.mark.parametrize("release", RELEASES)
def test_health_is_200_unless_the_engine_is_dead(release):
    health = ast.unparse(_function(ast.parse(_src(release, "entrypoints/serve/instrumentator/health.py")),
                                   "health"))
    assert "await client.check_health()" in health
    assert re.findall(r"status_code=(\d+)", health) == ["200", "200", "503"], health
    assert "except EngineDeadError:" in health
    check = _function(ast.parse(_src(release, "v1/engine/async_llm.py")), "check_health")
    body = [s for s in check.body if not isinstance(s, ast.Expr)]  # logger.debug(...) and docstrings aside
    assert len(body) == 1, ast.unparse(check)
    assert ast.unparse(body[0]).startswith("if self.errored:\n    raise"), ast.unparse(check)


@pytest.mark.parametrize("release", RELEASES)
def test_requests_past_max_num_seqs_wait(release):
    src = _src(release, "v1/core/sched/scheduler.py")
    assert "self.max_num_running_reqs = self.scheduler_config.max_num_seqs" in src
    assert re.search(r"if (len\(self\.running\) ==|num_running >=) self\.max_num_running_reqs:"
                     r"\s*\n\s*break", src)


@pytest.mark.parametrize("release", RELEASES)
def test_the_key_guards_v1_only(release):
    src = _src(release, AUTH[release])
    guarded = re.search(r'GUARDED_PREFIX = \(([^)]*)\)', src)
    prefixes = re.findall(r'"([^"]+)"', guarded.group(1)) if guarded else re.findall(
        r'url_path\.startswith\("([^"]+)"\) and not self\.verify_token', src)
    assert "/v1" in prefixes, prefixes
    assert not any("/metrics".startswith(p) or "/health".startswith(p) for p in prefixes), prefixes
    assert 'JSONResponse(content={"error": "Unauthorized"}, status_code=401)' in src


def _stream(srv: StandinServer, tokens: int) -> threading.Thread:
    def go() -> None:
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        body = {"model": "m", "stream": True, "max_tokens": tokens, "messages": [{"content": "x"}]}
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"Authorization": "Bearer k"})
        r = c.getresponse()
        while r.read(4096):
            pass
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _metrics_of(srv: StandinServer) -> wd.Sample:
    s, why, _ = wd.sample(srv.base_url, 2)
    assert s is not None, why
    return s


def test_the_standin_behaves_as_the_sources_say(tmp_path, monkeypatch):
    wedge = tmp_path / "engine"
    monkeypatch.setenv("STANDIN_ENGINE_WEDGE_FILE", str(wedge))
    with StandinServer(Config(model="m", max_running=1, step_time=0.01, api_key="k")) as srv:
        threads = [_stream(srv, 150), _stream(srv, 150)]  # 1.5 s each, one after the other
        time.sleep(0.4)
        a = _metrics_of(srv)
        assert (a.running, a.waiting) == (1, 1)  # past max_num_seqs: waiting
        time.sleep(0.3)
        b = _metrics_of(srv)
        assert b.generated > a.generated and b.finished == a.finished  # counted per step, mid-request
        wedge.touch()
        time.sleep(0.3)
        c = _metrics_of(srv)
        time.sleep(0.5)
        assert _metrics_of(srv).generated == c.generated  # hung: no step
        args = wd.parse_args(["--unit", "u", "--url", srv.base_url, "--state", str(tmp_path / "s"),
                              "--timeout", "2"])
        assert wd.health(args) == ""  # /health 200 while the engine hangs
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "p", "max_tokens": 1}),
                     {"Authorization": "Bearer wrong"})
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())) == (401, {"error": "Unauthorized"})
        wedge.unlink()
        for t in threads:
            t.join(30)


# ------------------------------------------------------------------------- prefill (issue 45)
PAIRS = ("16:64", "256:64")  # a chunk of 4 blocks; a chunk of a quarter block (hybrid models: big blocks)


@pytest.fixture(scope="module", params=list(RELEASES))
def prefill_run(request) -> tuple[str, dict[str, list[str]]]:
    """The release's own KV-cache manager and Prometheus logger through a prefill of 1000 tokens."""
    release = request.param
    _src(release, "v1/metrics/loggers.py")  # fails with the fix when the sources are missing
    env = dict(os.environ, PYTHONPATH=str(RELEASES[release].parent)) if release != "0.19.1" else None
    probe = Path(__file__).with_name("watchdog_prefill_probe.py")
    proc = subprocess.run([sys.executable, str(probe), *PAIRS], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PREFILL ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("PREFILL "):])
    assert got["version"] == release
    return release, got["runs"]


def _hist_count(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "_count"))


def test_a_prefill_step_moves_the_kv_gauge_and_no_token_counter(prefill_run):
    release, runs = prefill_run
    texts = runs["16:64"]
    samples = [wd.parse_metrics(t, i) for i, t in enumerate(texts)]
    assert len(samples) == math.ceil(999 / 64) + 1
    first = samples[0]
    for prev, cur in zip(samples, samples[1:], strict=False):
        assert (cur.generated, cur.prompt, cur.finished) == (first.generated, first.prompt, first.finished)
        assert cur.kv_usage > prev.kv_usage, (release, prev.kv_usage, cur.kv_usage)  # every chunk step
        assert wd._advanced(prev, cur).startswith("KV cache"), release
    # the per-iteration token histogram is observed only with IterationStats, i.e. with an output
    assert {_hist_count(t, "vllm:iteration_tokens_total") for t in texts} == {_hist_count(texts[0],
                                                                              "vllm:iteration_tokens_total")}
    # the prefix-cache lookup of the first scheduling counts the whole prompt once
    assert [s.prefix_queries for s in samples[:3]] == [0, 1000, 1000], release


def test_a_chunk_smaller_than_a_block_leaves_the_gauge_flat_for_some_steps(prefill_run):
    release, runs = prefill_run
    usage = [wd.parse_metrics(t, i).kv_usage for i, t in enumerate(runs["256:64"])]
    runs_of_equal, n = [], 1
    for a, b in zip(usage[1:], usage[2:], strict=False):
        n = n + 1 if a == b else (runs_of_equal.append(n) or 1)
    runs_of_equal.append(n)
    # flat across up to ceil(256 / 64) = 4 steps, never longer: the watchdog's --stall must cover that many
    # chunk steps (300 s by default: minutes per chunk)
    assert max(runs_of_equal) == math.ceil(256 / 64), (release, usage)
    assert usage[-1] > usage[1], release


@pytest.mark.parametrize("release", RELEASES)
def test_every_step_s_scheduler_stats_reach_the_logger_even_without_an_output(release):
    tree = ast.parse(_src(release, "v1/core/sched/scheduler.py"))
    sched = ast.unparse(_function(tree, "update_from_output"))
    assert re.search(r"if \(eco := next\(iter\(engine_core_outputs\.values\(\)\), None\)\) is None:\s*"
                     r"engine_core_outputs\[0\] = eco = EngineCoreOutputs\(\)\s*eco\.scheduler_stats = stats",
                     sched), release
    stats = ast.unparse(_function(tree, "make_stats"))
    assert "kv_cache_usage=self.kv_cache_manager.usage" in stats
    handler = ast.unparse(_function(ast.parse(_src(release, "v1/engine/async_llm.py")), "output_handler"))
    assert "IterationStats() if log_stats and num_outputs else None" in handler
    assert re.search(r"\.record\(engine_idx=outputs\.engine_index, scheduler_stats=outputs\.scheduler_stats,"
                     r" iteration_stats=iteration_stats", handler), release
    record = ast.unparse(_function(next(n for n in ast.walk(ast.parse(_src(release, "v1/metrics/loggers.py")))
                                        if isinstance(n, ast.ClassDef) and n.name == "PrometheusStatLogger"),
                                   "record"))
    head = record.split("if iteration_stats is None:")[0]
    assert "self.gauge_kv_cache_usage[engine_idx].set(scheduler_stats.kv_cache_usage)" in head
    assert "self.counter_prefix_cache_queries[engine_idx].inc(" in head
    assert "counter_prompt_tokens[engine_idx]" not in head and "counter_generation_tokens" not in head
    real = _metrics(release)
    assert (real["vllm:kv_cache_usage_perc"], real["vllm:prefix_cache_queries"]) == ("gauge", "counter")
    assert wd.KV_USAGE == "vllm:kv_cache_usage_perc"
    assert _exposed("vllm:prefix_cache_queries", "counter") == wd.PREFIX_QUERIES
