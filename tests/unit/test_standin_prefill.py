"""The stand-in's chunked prefill (tests/fixtures/standin_server/engine.py, issue 45): with
``--max-num-batched-tokens N`` a prompt of P tokens takes ceil(P / N) engine steps that emit nothing, during
which only ``vllm:kv_cache_usage_perc`` (and, at scheduling, ``vllm:prefix_cache_queries_total``) move, as
vLLM 0.19.1 and 0.26.0 move them (tests/contract/test_watchdog_contract.py); the ops watchdog judges such a
prefill busy or alive, never stalled, and a wedged engine stops the prefill and the gauge."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import ops_watchdog as wd
import pytest

from tests.fixtures.standin_server import engine
from tests.fixtures.standin_server.server import Config, StandinServer, parse_args

WORDS = 1023  # prompt tokens = round(1023 * 1.0) + 1 = 1024: 16 chunks of 64


def _ask(srv: StandinServer, words: int = WORDS) -> threading.Thread:
    def go() -> None:
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        c.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "m", "stream": True, "max_tokens": 2,
             "messages": [{"role": "user", "content": " ".join(["w"] * words)}]}))
        r = c.getresponse()
        while r.read(4096):
            pass
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _sample(srv: StandinServer) -> wd.Sample:
    s, why, _ = wd.sample(srv.base_url, 5)
    assert s is not None, why
    return s


def _wait(cond, what: str, limit: float = 10.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_the_flag_is_read_from_the_vllm_flags_and_absent_means_no_chunking() -> None:
    cfg, _, _ = parse_args(["serve", "m", "--max-num-batched-tokens", "4096", "--port", "1"])
    assert cfg.max_num_batched_tokens == 4096
    cfg, _, _ = parse_args(["serve", "m", "--max-num-batched-tokens=512"])
    assert cfg.max_num_batched_tokens == 512
    assert parse_args(["serve", "m"])[0].max_num_batched_tokens == 0


def test_without_the_flag_the_metrics_are_as_before() -> None:
    with StandinServer(Config(model="m", step_time=0.001)) as srv:
        _ask(srv, 10).join(30)
        text = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        text.request("GET", "/metrics")
        body = text.getresponse().read().decode()
        assert "vllm:prefix_cache_queries" not in body
        s = _sample(srv)
        assert (s.prompt, s.finished, s.kv_usage, s.prefix_queries) == (11, 1, 0.0, None)


def test_a_chunked_prefill_moves_only_the_kv_cache_and_the_watchdog_sees_progress() -> None:
    cfg = Config(model="m", step_time=0.001, prefill_per_token=0.002, max_num_batched_tokens=64)
    with StandinServer(cfg) as srv:
        base = _sample(srv)
        t = _ask(srv)
        _wait(lambda: srv.engine.c.kv_tokens >= 64, "the first chunk")
        during = [_sample(srv)]
        while srv.engine.c.kv_tokens < 1024 - 128:  # sample while at least two chunks remain
            time.sleep(0.05)
            during.append(_sample(srv))
        assert len({s.kv_usage for s in during}) >= 5, [s.kv_usage for s in during]
        assert all(b.kv_usage >= a.kv_usage for a, b in zip(during, during[1:], strict=False))
        for s in during:  # no output yet: the token counters and the success count stand still
            assert (s.generated, s.prompt, s.finished) == (base.generated, base.prompt, base.finished)
            assert s.running == 1 and s.prefix_queries == 1024
        # every KV value is a whole number of 64-token chunks of the stand-in's cache
        assert all(round((s.kv_usage - 0.01) * engine.KV_TOKENS) % 64 == 0 for s in during)
        # the watchdog, with a stall limit shorter than the prefill, never calls it stalled
        prev, progress_at = base, None
        for s in during:
            v = wd.judge(prev, s, progress_at, 0.3)
            assert v.kind != "fail", v
            prev, progress_at = s, v.progress_at
        t.join(30)
        end = _sample(srv)
        assert (end.prompt, end.finished, end.generated) == (1024, 1, 2)  # prompt tokens in one jump
        assert end.kv_usage == 0.0  # the finished request's blocks are free again


def test_a_wedged_engine_stops_the_prefill_and_its_gauge(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    wedge = tmp_path / "engine"
    monkeypatch.setenv(engine.ENGINE_WEDGE_ENV, str(wedge))
    cfg = Config(model="m", step_time=0.001, prefill_per_token=0.002, max_num_batched_tokens=64)
    with StandinServer(cfg) as srv:
        t = _ask(srv)
        _wait(lambda: srv.engine.c.kv_tokens >= 128, "two chunks")
        wedge.touch()
        time.sleep(0.3)  # at most one chunk in progress ends
        a = _sample(srv)
        time.sleep(0.5)
        b = _sample(srv)
        assert (b.kv_usage, b.generated, b.prompt) == (a.kv_usage, a.generated, a.prompt)
        assert a.kv_usage < 0.01 + 1024 / engine.KV_TOKENS
        v = wd.judge(a, b, a.t, 0.3)
        assert v.kind == "fail" and "KV cache unchanged" in v.reason
        wedge.unlink()
        t.join(30)
        assert _sample(srv).prompt == 1024
