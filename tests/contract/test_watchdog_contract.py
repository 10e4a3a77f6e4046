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
* the stand-in (tests/fixtures/standin_server) behaves so: checked against the same facts.
"""

from __future__ import annotations

import ast
import http.client
import json
import re
import threading
import time
from pathlib import Path

import ops_watchdog as wd
import pytest
from fixtures.standin_server.server import Config, StandinServer

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
