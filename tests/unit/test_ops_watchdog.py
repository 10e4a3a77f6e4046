"""scripts/ops_watchdog.py: the pure decision over /metrics samples, and whole runs against the stand-in
server (engine hang, /health wedge, max_num_seqs queue) with a fake systemctl (issues 24, 29)."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

import ops_watchdog as wd
import pytest
from ops_watchdog import Probe, Sample

from tests.fixtures.standin_server.server import Config, StandinServer


def s(t: float, gen: float = 0, running: float = 0, waiting: float = 0, prompt: float = 0, done: float = 0,
      started: float | None = 1.0) -> Sample:
    return Sample(t, gen, prompt, done, running, waiting, started)


# ------------------------------------------------------------------------------- judge (pure)
def test_tokens_that_advance_are_progress_whatever_the_latency() -> None:
    v = wd.judge(s(0, gen=100, running=4, waiting=3), s(30, gen=160, running=4, waiting=3), 0.0, 300)
    assert v.kind == "ok" and v.progress_at == 30 and "+60 tokens" in v.reason and "3 waiting" in v.reason


def test_a_finished_request_or_prompt_tokens_are_progress_too() -> None:
    assert wd.judge(s(0, gen=5, running=1), s(30, gen=5, running=1, done=1), 0.0, 300).kind == "ok"
    assert wd.judge(s(0, gen=5, running=1), s(30, gen=5, running=1, prompt=9), 0.0, 300).kind == "ok"


def test_in_flight_without_progress_fails_only_after_the_stall_time() -> None:
    prev = s(0, gen=100, running=4)
    busy = wd.judge(prev, s(30, gen=100, running=4), 0.0, 300)
    assert busy.kind == "busy" and busy.progress_at == 0.0 and "30 s of 300 s" in busy.reason
    stalled = wd.judge(s(270, gen=100, running=4), s(300, gen=100, running=4), 0.0, 300)
    assert stalled.kind == "fail" and "no token generated for 300 s" in stalled.reason


def test_requests_that_just_arrived_start_the_stall_clock() -> None:
    # idle before, 4 in flight now, nothing generated yet (their prefill runs): not a stall, the clock starts
    v = wd.judge(s(0, gen=100), s(30, gen=100, running=4), None, 10)
    assert v.kind == "busy" and v.progress_at == 30
    # nor on the very first look
    v = wd.judge(None, s(30, gen=100, running=4), None, 10)
    assert v.kind == "busy" and v.progress_at == 30


def test_waiting_requests_alone_are_in_flight() -> None:
    v = wd.judge(s(0, gen=7, waiting=2), s(400, gen=7, waiting=2), 0.0, 300)
    assert v.kind == "fail" and "0 running, 2 waiting" in v.reason


def test_idle_asks_for_a_probe() -> None:
    assert wd.judge(s(0, gen=7), s(30, gen=7), None, 300).kind == "probe"
    assert wd.judge(None, s(30, gen=7), None, 300).kind == "probe"


def test_a_restarted_server_is_a_new_baseline_not_a_stall() -> None:
    # counters went back (a new process): no progress claimed, no stall either
    v = wd.judge(s(0, gen=900, running=2), s(400, gen=3, running=2, started=2.0), 0.0, 300)
    assert v.kind == "busy" and v.progress_at == 400


def p(t: float, kv: float, queries: float = 1.0, running: float = 1, gen: float = 100) -> Sample:
    """A sample in a chunked prefill: tokens, prompt tokens and successes stand still."""
    return Sample(t, gen, 50, 3, running, 0, 1.0, kv, queries)


def test_a_long_prefill_that_only_moves_the_kv_cache_is_never_a_failure() -> None:
    # 20 minutes of one prompt's prefill, read every 30 s with --stall 300: only the KV-cache gauge moves,
    # and only every third look (a chunk smaller than a block leaves the gauge flat for some steps)
    prev, progress_at, kinds = p(0, 0.01), 0.0, []
    for i in range(1, 41):
        cur = p(30 * i, 0.01 + 0.002 * (i // 3))
        v = wd.judge(prev, cur, progress_at, 300)
        kinds.append(v.kind)
        prev, progress_at = cur, v.progress_at
    assert "fail" not in kinds and kinds.count("ok") == 13, kinds
    moved = wd.judge(p(0, 0.25), p(30, 0.3), 0.0, 300)
    assert moved.kind == "ok" and moved.progress_at == 30 and "KV cache 25% -> 30%" in moved.reason
    # the gauge going down is a change too (blocks freed), as is a request newly scheduled
    assert wd.judge(p(0, 0.3), p(30, 0.2), 0.0, 300).kind == "ok"
    q = wd.judge(p(0, 0.3, queries=100), p(30, 0.3, queries=4196), 0.0, 300)
    assert q.kind == "ok" and "+4096 prefix-cache queries" in q.reason


def test_a_hung_engine_whose_gauges_stand_still_fails_after_the_stall_as_before() -> None:
    prev, progress_at, verdicts = p(0, 0.4), 0.0, []
    for i in range(1, 12):
        v = wd.judge(prev, p(30 * i, 0.4), progress_at, 300)
        verdicts.append(v)
        prev, progress_at = p(30 * i, 0.4), v.progress_at
    assert [v.kind for v in verdicts] == ["busy"] * 9 + ["fail"] * 2  # at 300 s, as with the counters alone
    assert "no token generated for 300 s" in verdicts[9].reason and "KV cache unchanged" in verdicts[9].reason


def test_a_server_without_the_prefill_series_is_judged_by_the_counters_alone() -> None:
    # None (not exposed) on either side is no change, never progress
    assert wd.judge(p(0, None), p(30, 0.5), 0.0, 300).kind == "busy"  # type: ignore[arg-type]
    assert wd.judge(p(0, 0.5, None), p(30, 0.5, 7), 0.0, 300).kind == "busy"  # type: ignore[arg-type]
    # prefix-cache queries going back: another server, a new baseline rather than progress
    v = wd.judge(p(0, 0.5, queries=900), p(30, 0.6, queries=3), 0.0, 300)
    assert v.kind == "busy" and v.progress_at == 30


def test_parse_metrics_reads_the_prefill_series() -> None:
    text = ('vllm:generation_tokens_total{engine="0"} 1\nvllm:num_requests_running{engine="0"} 1\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096.0\n'
            'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n')
    got = wd.parse_metrics(text, 1.0)
    assert (got.kv_usage, got.prefix_queries) == (0.375, 4096.0)
    bare = wd.parse_metrics('vllm:generation_tokens_total 1\nvllm:num_requests_running 1\n', 1.0)
    assert (bare.kv_usage, bare.prefix_queries) == (None, None)


@pytest.mark.parametrize("name", ["vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total"])
@pytest.mark.parametrize("bad", ["NaN", "-0.5", "+Inf"])
def test_non_finite_or_negative_prefill_series_are_no_answer(name: str, bad: str) -> None:
    text = f'vllm:generation_tokens_total 5\nvllm:num_requests_running 1\n{name}{{engine="0"}} {bad}\n'
    with pytest.raises(wd.NoAnswer, match=rf"{name} is .*no answer"):
        wd.parse_metrics(text, 1.0)


def test_a_state_sample_from_before_the_prefill_series_is_still_read() -> None:
    old = {"t": 1.0, "generated": 2.0, "prompt": 3.0, "finished": 0.0, "running": 1.0, "waiting": 0.0,
           "started": 5.0}
    assert wd._sample_of(old) == Sample(1.0, 2.0, 3.0, 0.0, 1.0, 0.0, 5.0)
    assert wd._sample_of({**old, "kv_usage": 0.5, "prefix_queries": 9.0}).kv_usage == 0.5
    assert wd._sample_of({**old, "kv_usage": float("nan")}) is None
    assert wd._sample_of({**old, "prefix_queries": -1.0}) is None
    assert wd._sample_of({**old, "other": 1.0}) is None


def test_probe_verdicts() -> None:
    cur = s(0, gen=7)
    assert wd.judge_probe(cur, Probe(200, seconds=0.2), None, "m", None).kind == "ok"
    for code in (401, 403):
        v = wd.judge_probe(cur, Probe(code), None, "m", "/etc/key")
        assert v.kind == "config" and f"HTTP {code}" in v.reason and "/etc/key" in v.reason
        assert "vllm_api_key_file" in v.reason
    v = wd.judge_probe(cur, Probe(404), None, "qwen", None)
    assert v.kind == "config" and "'qwen'" in v.reason and "vllm_served_model_name" in v.reason
    assert wd.judge_probe(cur, Probe(500), s(5, gen=7), "m", None).kind == "fail"
    hung = wd.judge_probe(cur, Probe(None, "TimeoutError: timed out"), s(10, gen=7), "m", None)
    assert hung.kind == "fail" and "TimeoutError" in hung.reason
    # a burst arrived as the probe went out: the tokens it got are progress, the probe's wait is not a failure
    burst = wd.judge_probe(cur, Probe(None, "TimeoutError"), s(10, gen=40, running=4, waiting=1), "m", None)
    assert burst.kind == "busy" and "+33 tokens" in burst.reason


def test_parse_metrics_sums_engines_and_names_what_is_missing() -> None:
    text = ('# TYPE vllm:generation_tokens counter\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 10.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="m"} 5.0\n'
            'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0\n'
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0\n'
            'process_start_time_seconds 1.5e9\n')
    got = wd.parse_metrics(text, 7.0)
    assert (got.generated, got.running, got.waiting, got.finished, got.started) == (15, 2, 1, 4, 1.5e9)
    with pytest.raises(ValueError, match=r"no vllm:generation_tokens_total or vllm:num_requests_running.*"
                                         r"--disable-log-stats"):
        wd.parse_metrics("process_start_time_seconds 1.0\n", 0)


# ------------------------------------------------------------------ whole runs against the stand-in
def _fake_systemctl(tmp_path: Path, fake: Path, calls: Path) -> None:
    """A systemctl that reports tmp_path/active as the unit's state and records every other call."""
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = show ]; then echo ActiveState=$(cat {tmp_path}/active); echo InvocationID=inv1; '
        "echo ActiveEnterTimestampMonotonic=0; exit 0; fi\n"
        f'echo "$@" >> {calls}\n'
    )
    fake.chmod(0o755)
    (tmp_path / "active").write_text("active\n")


@pytest.fixture
def bed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    wedge, engine_wedge = tmp_path / "wedge", tmp_path / "engine-wedge"
    monkeypatch.setenv("STANDIN_WEDGE_FILE", str(wedge))
    monkeypatch.setenv("STANDIN_ENGINE_WEDGE_FILE", str(engine_wedge))
    calls = tmp_path / "calls"
    fake = tmp_path / "systemctl"
    _fake_systemctl(tmp_path, fake, calls)
    srv = StandinServer(Config(model="m", max_running=2, step_time=0.01)).start()
    yield tmp_path, wedge, engine_wedge, calls, fake, srv
    wedge.unlink(missing_ok=True)
    engine_wedge.unlink(missing_ok=True)
    srv.stop()


def _args(tmp: Path, fake: Path, srv: StandinServer, *extra: str):
    return wd.parse_args(["--unit", "u.service", "--url", srv.base_url, "--state", str(tmp / "st.json"),
                          "--failures", "2", "--max-restarts", "1", "--timeout", "0.5", "--grace", "0",
                          "--stall", "0.3", "--timer", "w.timer", "--systemctl", str(fake),
                          "--completion-model", "m", *extra])


def _calls(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def _last(tmp: Path) -> dict:
    return json.loads((tmp / "st.json").read_text())["last"]


def _long_requests(srv: StandinServer, n: int, tokens: int) -> list[threading.Thread]:
    def one() -> None:
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        c.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "m", "stream": True, "max_tokens": tokens,
             "messages": [{"role": "user", "content": "x"}]}),
            {"Content-Type": "application/json"})
        r = c.getresponse()
        while r.read(4096):
            pass
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _wait_running(srv: StandinServer, running: int, waiting: int) -> None:
    end = time.monotonic() + 5
    while time.monotonic() < end:
        if (srv.engine.c.running, srv.engine.c.waiting) == (running, waiting):
            return
        time.sleep(0.02)
    raise AssertionError((srv.engine.c.running, srv.engine.c.waiting))


def test_max_num_seqs_long_requests_in_flight_are_never_restarted(bed) -> None:
    tmp, _, _, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    threads = _long_requests(srv, 3, 400)  # 2 run (max_running), 1 waits; ~4 s each
    _wait_running(srv, 2, 1)
    # the stand-in as vLLM: at max_num_seqs a one-token request waits in the queue (the old probe's failure)
    assert wd.probe_completion(a, None).status is None
    for _ in range(6):
        assert wd.run(a) == 0
        time.sleep(0.35)  # longer than --stall: only progress keeps it alive
    assert _calls(calls) == []
    assert _last(tmp)["kind"] == "ok" and "tokens" in _last(tmp)["reason"]
    for t in threads:
        t.join(30)


def test_a_hung_engine_behind_a_healthy_api_is_restarted(bed, capsys) -> None:
    tmp, _, engine_wedge, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    threads = _long_requests(srv, 2, 2000)
    _wait_running(srv, 2, 0)
    assert wd.run(a) == 0
    engine_wedge.touch()  # tokens stop; /health still answers 200, as vLLM's does
    try:
        assert wd.health(a) == ""
        results = []
        for _ in range(6):
            results.append(wd.run(a))
            time.sleep(0.2)
            if _calls(calls):
                break
        assert _calls(calls) == ["restart --no-block u.service"], capsys.readouterr().out
        out = capsys.readouterr().out
        assert "stalled: 2 running, 0 waiting, no token generated for" in out, out
    finally:
        engine_wedge.unlink()
    for t in threads:
        t.join(60)


def test_an_idle_hung_engine_fails_the_one_token_probe(bed, capsys) -> None:
    tmp, _, engine_wedge, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    assert wd.run(a) == 0 and _last(tmp)["kind"] == "ok"  # idle, one token answered
    engine_wedge.touch()
    try:
        assert wd.run(a) == 0 and wd.run(a) == 0
    finally:
        engine_wedge.unlink()
    assert _calls(calls) == ["restart --no-block u.service"]
    assert "idle, and the one-token probe failed: no answer (TimeoutError" in capsys.readouterr().out


def test_wedged_health_restarts_after_n_failures_then_gives_up(bed, capsys) -> None:
    tmp, wedge, _, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    assert wd.run(a) == 0 and _calls(calls) == []  # healthy
    wedge.touch()  # the process lives on, /health hangs
    assert wd.run(a) == 0 and _calls(calls) == []  # 1 of 2
    assert wd.run(a) == 0 and _calls(calls) == ["restart --no-block u.service"]
    assert wd.run(a) == 0 and wd.run(a) == 1  # one restart allowed per window: gave up
    assert _calls(calls)[1:] == ["stop --no-block u.service", "stop --no-block w.timer"]
    assert "GAVE UP" in capsys.readouterr().out
    assert json.loads((tmp / "st.json").read_text())["gave_up"] > 0


def test_a_stopped_unit_is_never_probed_nor_started(bed) -> None:
    tmp, wedge, _, calls, fake, srv = bed
    (tmp / "active").write_text("inactive\n")
    wedge.touch()
    a = _args(tmp, fake, srv)
    for _ in range(4):
        assert wd.run(a) == 0
    assert _calls(calls) == []


def test_a_loading_server_is_not_judged_within_its_grace(bed) -> None:
    tmp, wedge, _, calls, fake, srv = bed
    wedge.touch()
    a = _args(tmp, fake, srv, "--grace", str(10**9))
    for _ in range(4):
        assert wd.run(a) == 0
    assert _calls(calls) == []


def test_a_start_after_the_give_up_resets_the_rate_limit(bed, capsys) -> None:
    tmp, wedge, _, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    wedge.touch()
    results = [wd.run(a) for _ in range(4)]  # 2 failures -> restart, 2 more -> give up
    assert results == [0, 0, 0, 1]
    # the operator fixed it and started unit and timer again: the next failures restart, not give up
    assert wd.run(a) == 0 and wd.run(a) == 0
    assert _calls(calls)[-1] == "restart --no-block u.service"
    assert "restart count reset" in capsys.readouterr().out
    assert not json.loads((tmp / "st.json").read_text())["gave_up"]


def test_a_pause_file_stops_judging_and_a_stale_one_is_ignored(bed, capsys) -> None:
    tmp, wedge, _, calls, fake, srv = bed
    pause = tmp / "pause"
    pause.write_text("serve: switch to mtp\n")
    a = _args(tmp, fake, srv, "--pause-file", str(pause), "--pause-max", "3600")
    wedge.touch()
    for _ in range(4):
        assert wd.run(a) == 0
    assert _calls(calls) == []
    out = capsys.readouterr().out
    assert out.count("paused while serve: switch to mtp runs") == 1, out  # said once
    stale = time.time() - 7200
    os.utime(pause, (stale, stale))
    assert wd.run(a) == 0 and wd.run(a) == 0
    assert _calls(calls) == ["restart --no-block u.service"]
    assert capsys.readouterr().out.count(f"ignoring the stale pause file {pause}") == 1


def test_a_wrong_key_is_a_configuration_error_said_once_and_never_a_restart(tmp_path, monkeypatch,
                                                                          capsys) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "")
    key = tmp_path / "key"
    key.write_text("k-0ld-9x\n")
    fake = tmp_path / "systemctl"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = show ]; then echo ActiveState=active; echo InvocationID=i; "
                    f"exit 0; fi\necho \"$@\" >> {tmp_path}/calls\n")
    fake.chmod(0o755)
    with StandinServer(Config(model="m", api_key="s3cret")) as srv:
        a = _args(tmp_path, fake, srv, "--api-key-file", str(key))
        for _ in range(5):
            assert wd.run(a) == 0
        out = capsys.readouterr().out
        assert out.count("CONFIGURATION ERROR") == 1, out
        assert "refused the one-token probe (HTTP 401)" in out
        assert "k-0ld-9x" not in out  # the key is never logged
        assert not (tmp_path / "calls").exists()
        key.write_text("s3cret\n")
        assert wd.run(a) == 0
        assert "the configuration error is gone" in capsys.readouterr().out
        assert _last(tmp_path)["kind"] == "ok"
        # a wrong model name (vLLM: 404) is one too
        b = _args(tmp_path, fake, srv, "--api-key-file", str(key), "--completion-model", "other")
        assert wd.run(b) == 0 and wd.run(b) == 0
        out = capsys.readouterr().out
        assert out.count("does not serve model 'other' (HTTP 404)") == 1, out
        assert not (tmp_path / "calls").exists()


def test_a_missing_key_file_is_one_line_not_a_traceback(bed, capsys) -> None:
    tmp, _, _, calls, fake, srv = bed
    a = _args(tmp, fake, srv, "--api-key-file", str(tmp / "nope"))
    assert wd.main(["--unit", "u.service", "--url", srv.base_url, "--state", str(tmp / "st.json"),
                    "--systemctl", str(fake), "--completion-model", "m",
                    "--api-key-file", str(tmp / "nope")]) == 0
    assert wd.run(a) == 0
    out = capsys.readouterr()
    lines = [x for x in out.out.splitlines() if x]
    assert len(lines) == 1 and f"cannot read the API key file {tmp / 'nope'}" in lines[0], out
    assert "Traceback" not in out.out + out.err
    assert _calls(calls) == []


# ------------------------------------------------------------- the role's grace, from the serve stage
def _grace(**play: object) -> tuple[int, int]:
    import jinja2
    import yaml
    from ansible.plugins.filter.core import FilterModule as CoreFilters

    roles = Path(__file__).resolve().parents[2] / "roles"
    env = jinja2.Environment()
    env.filters.update({k: f for k, f in CoreFilters().filters().items() if k not in ("default", "d")})
    ops = yaml.safe_load((roles / "spark_ops" / "defaults" / "main.yml").read_text())
    shared = yaml.safe_load((roles.parent / "group_vars" / "all" / "shared.yml").read_text())
    ctx = {**shared, **play}
    grace = env.from_string(ops["spark_ops_watchdog_grace"]).render(ctx)
    pause_max = env.from_string(ops["spark_ops_watchdog_pause_max"]).render(spark_ops_watchdog_grace=grace)
    return int(grace), int(pause_max)


def test_the_grace_covers_the_longest_start_the_serve_stage_accepts() -> None:
    from sparkllm.serve_phases import DEFAULT_BUDGETS

    # the serve role's budgets are serve_phases' defaults; their sum exceeds serve_ready_timeout (7200)
    assert _grace() == (sum(DEFAULT_BUDGETS.values()), 2 * sum(DEFAULT_BUDGETS.values()))
    assert _grace(serve_ready_timeout=20000)[0] == 20000
    # a budget the owner raised counts, beside the others' defaults
    raised = {**DEFAULT_BUDGETS, "weights": 50000}
    assert _grace(serve_phase_budgets=raised)[0] == sum(DEFAULT_BUDGETS.values()) - 1800 + 50000


def test_state_file_is_what_the_exporter_reads(tmp_path: Path) -> None:
    """The watchdog's state is the GB10 exporter's source of the give-up alert (scripts/gb10_exporter.py,
    file contract in its docstring): readable by other users, and a give-up exported as 1."""
    import gb10_exporter

    state = tmp_path / "watchdog.json"
    wd.save_state(state, {"restarts": [time.time()], "gave_up": time.time(), "failures": 0})
    assert state.stat().st_mode & 0o777 == 0o644
    text = "\n".join(gb10_exporter.ops_metrics(tmp_path))
    assert "sparkllm_watchdog_gave_up 1" in text and 'sparkllm_ops_state_up{file="watchdog.json"} 1' in text


# ------------------------------------------------------------------ a worker's Ray node (--ray-node)
class _Agent:
    """Stand-in for a Ray node's dashboard agent: /api/local_raylet_healthz with a settable answer."""

    def __init__(self) -> None:
        import http.server

        agent = self
        self.answer = (200, "success")

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                status, text = agent.answer if self.path == "/api/local_raylet_healthz" else (404, "")
                body = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def ray_bed(tmp_path: Path):
    calls, fake = tmp_path / "calls", tmp_path / "systemctl"
    _fake_systemctl(tmp_path, fake, calls)
    agent = _Agent()
    yield tmp_path, calls, fake, agent
    agent.stop()


def _ray_args(tmp: Path, fake: Path, node: str, head: str) -> object:
    return wd.parse_args(["--unit", "sparkllm-ray-worker.service", "--ray-node", node, "--ray-head", head,
                          "--state", str(tmp / "st.json"), "--failures", "2", "--max-restarts", "1",
                          "--timeout", "0.5", "--grace", "0", "--timer", "w.timer", "--systemctl", str(fake)])


def test_ray_node_judged_by_its_agents_raylet_health() -> None:
    assert wd.judge_ray_node(200, "success\n").kind == "ok"
    dead = wd.judge_ray_node(503, "Local Raylet failed")
    assert dead.kind == "fail" and "holds this Ray node dead: Local Raylet failed" in dead.reason
    gone = wd.judge_ray_node(None, "", "ConnectionRefusedError: refused")
    assert gone.kind == "fail" and "does not answer (ConnectionRefusedError" in gone.reason
    assert wd.judge_ray_node(200, "maybe").kind == "fail"  # only Ray's own word counts


def test_a_dead_ray_node_is_restarted_and_an_unreachable_head_only_reported(ray_bed, capsys) -> None:
    tmp, calls, fake, agent = ray_bed
    head = f"127.0.0.1:{_closed_port()}"
    a = _ray_args(tmp, fake, agent.url, head)
    assert wd.run(a) == 0 and _calls(calls) == []
    out = capsys.readouterr().out
    assert out.count("does not answer over the link") == 1 and "nothing restarted" in out
    assert _last(tmp)["kind"] == "ok"
    assert wd.run(a) == 0 and "does not answer over the link" not in capsys.readouterr().out  # said once
    agent.answer = (503, "Local Raylet failed")
    assert wd.run(a) == 0 and _calls(calls) == []  # 1 of 2
    assert wd.run(a) == 0
    assert _calls(calls) == ["restart --no-block sparkllm-ray-worker.service"]
    assert "holds this Ray node dead" in capsys.readouterr().out


def test_a_ray_node_without_its_agent_gives_up_after_the_allowed_restarts(ray_bed, capsys) -> None:
    tmp, calls, fake, agent = ray_bed
    a = _ray_args(tmp, fake, f"http://127.0.0.1:{_closed_port()}", f"127.0.0.1:{_closed_port()}")
    rcs = [wd.run(a) for _ in range(4)]
    assert rcs == [0, 0, 0, 1]
    assert _calls(calls) == ["restart --no-block sparkllm-ray-worker.service",
                             "stop --no-block sparkllm-ray-worker.service", "stop --no-block w.timer"]
    assert "GAVE UP" in capsys.readouterr().out
    # stopped by the give-up (or by the operator): nothing is probed, nothing started
    (tmp / "active").write_text("inactive\n")
    assert wd.run(a) == 0 and len(_calls(calls)) == 3


def test_ray_head_needs_ray_node(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        wd.parse_args(["--unit", "u", "--url", "http://x", "--state", "s", "--ray-head", "h:1"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        wd.parse_args(["--unit", "u", "--url", "http://x", "--ray-node", "http://y", "--state", "s"])


# ------------------------------------------------------- the watchdog's own state and odd /metrics (issue 46)
def test_wrong_value_types_in_the_state_are_repaired_and_valid_fields_kept(bed, capsys) -> None:
    tmp, _, _, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    now = time.time()
    (tmp / "st.json").write_text(json.dumps({
        "restarts": [now - 10, "soon", None], "failures": "many", "progress_at": "x", "gave_up": [1],
        "sample": {"t": "a", "generated": 1}, "healthy_seen": "yes", "invocation": "inv1", "last": 5}))
    assert wd.run(a) == 0 and wd.run(a) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    reset = [x for x in out.out.splitlines() if "reset" in x]
    assert len(reset) == 1, out.out  # one line, said once: the second run reads the repaired file
    assert str(tmp / "st.json") in reset[0]
    for field in ("restarts", "failures", "progress_at", "gave_up", "sample", "healthy_seen", "last"):
        assert field in reset[0], reset[0]
    st = json.loads((tmp / "st.json").read_text())
    assert st["restarts"] == [now - 10]  # the valid restart is kept: the rate limit still counts it
    assert st["invocation"] == "inv1" and isinstance(st["failures"], int) and st["last"]["kind"] == "ok"
    assert _calls(calls) == []


def test_a_corrupt_state_is_kept_beside_it_and_said(bed, capsys) -> None:
    tmp, _, _, _, fake, srv = bed
    a = _args(tmp, fake, srv)
    (tmp / "st.json").write_text('{"restarts": [17')
    assert wd.run(a) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if "corrupt" in x]
    assert len(line) == 1 and str(tmp / "st.json") in line[0], out
    assert (tmp / "st.json.corrupt").read_text() == '{"restarts": [17'  # the restart history is not lost
    assert str(tmp / "st.json.corrupt") in line[0]
    assert json.loads((tmp / "st.json").read_text())["last"]["kind"] == "ok"


def test_an_unwritable_state_dir_still_restarts_a_hung_engine(bed, capsys, monkeypatch) -> None:
    """The state's directory cannot be written (a file stands where it should be; as root no mode
    stops a write): the state moves to the fallback directory and the failures still count."""
    tmp, _, engine_wedge, calls, fake, srv = bed
    (tmp / "ro").write_text("")
    monkeypatch.setattr(wd, "FALLBACK_DIR", tmp / "run")
    a = _args(tmp, fake, srv)
    a.state = tmp / "ro" / "st.json"
    engine_wedge.touch()
    try:
        assert wd.run(a) == 0 and wd.run(a) == 0 and wd.run(a) == 0
    finally:
        engine_wedge.unlink()
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert _calls(calls) == ["restart --no-block u.service"], out.out
    moved = [x for x in out.out.splitlines() if "cannot write" in x]
    assert len(moved) == 1 and str(a.state) in moved[0] and str(tmp / "run") in moved[0], out.out


def test_no_writable_state_anywhere_restarts_on_the_failure_and_says_so(bed, capsys, monkeypatch) -> None:
    tmp, _, engine_wedge, calls, fake, srv = bed
    (tmp / "ro").write_text("")
    monkeypatch.setattr(wd, "FALLBACK_DIR", tmp / "ro" / "run")
    a = _args(tmp, fake, srv)
    a.state = tmp / "ro" / "st.json"
    assert wd.run(a) == 0 and _calls(calls) == []  # healthy: nothing to do, said, no traceback
    engine_wedge.touch()
    try:
        assert wd.run(a) == 0
    finally:
        engine_wedge.unlink()
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert _calls(calls) == ["restart --no-block u.service"], out.out
    line = [x for x in out.out.splitlines() if "restarting" in x][-1]
    assert "state" in line and "cannot be written" in line and str(a.state) in line, line


@pytest.mark.parametrize("bad", ["NaN", "-1", "+Inf", "-Inf"])
def test_non_finite_or_negative_metrics_are_no_answer(bad: str) -> None:
    text = (f"vllm:generation_tokens_total{{engine=\"0\"}} {bad}\n"
            "vllm:num_requests_running{engine=\"0\"} 2.0\n")
    with pytest.raises(ValueError, match=r"vllm:generation_tokens_total.*no answer"):
        wd.parse_metrics(text, 1.0)
    text = ("vllm:generation_tokens_total{engine=\"0\"} 5\n"
            f"vllm:num_requests_running{{engine=\"0\"}} {bad}\n")
    with pytest.raises(ValueError, match="vllm:num_requests_running"):
        wd.parse_metrics(text, 1.0)


def test_nan_metrics_of_a_hung_engine_end_in_a_restart_not_busy_forever(bed, monkeypatch, capsys) -> None:
    tmp, _, _, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    real = wd._request

    def nan_metrics(url: str, timeout: float, headers: dict, body: bytes | None = None):
        if url.endswith("/metrics"):
            return 200, (b"vllm:generation_tokens_total 5\nvllm:num_requests_running NaN\n"
                         b"vllm:num_requests_waiting 0\n")
        return real(url, timeout, headers, body)

    monkeypatch.setattr(wd, "_request", nan_metrics)
    assert wd.run(a) == 0 and wd.run(a) == 0
    assert _calls(calls) == ["restart --no-block u.service"]
    assert "vllm:num_requests_running" in capsys.readouterr().out
