"""An engine that stalls inside a measured run (issue 46 item 4). It was reported valid: wedged for 45 s
mid-run, `valid`, no warning, one request 45.6 s against 0.63 s for the others; wedged for good, no message
for minutes (the 600 s per-read timeout). Now a stall of --stall-timeout seconds makes the run invalid, a
request far slower than its like is named in a warning, and a stall of --stall-give-up seconds ends the run
in one line, the requests measured written and stored as a partial, invalid run.

The stand-in's engine wedge (STANDIN_ENGINE_WEDGE_FILE, tests/fixtures/standin_server/engine.py) stops its
steps as a hung vLLM engine does: no chunk, no rise of vllm:generation_tokens_total, /metrics still answers.
The waits below are for the stand-in's progress and bound how long a broken runner may hang the test; no
assertion is about speed."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import bench
import pytest
from sparkllm.bench import store as bench_store
from sparkllm.bench.client import RequestResult

from tests.fixtures.standin_server import Config, StandinServer
from tests.unit.bench_helpers import write_prompts


def _req(idx: int, cat: str, tokens: int, e2e: float) -> RequestResult:
    r = RequestResult(idx, f"{cat}-{idx}", cat, 0, ok=True, output_tokens=tokens, t0=0.0)
    r.t_end = e2e  # a whole request: e2e_s = t_end - t0
    return r


def test_outliers_compare_like_with_like() -> None:
    """Long code answers are slower than short math ones, and that is not an outlier; the issue's request
    (45.6 s where its like took 0.63 s) is, and it is named."""
    from sparkllm.bench.stall import outliers

    rs = [_req(i, "code", 600 + 40 * i, 12.0 + 0.8 * i + 0.05 * (i % 3)) for i in range(6)]
    rs += [_req(10 + i, "math", 30 + 2 * i, 0.61 + 0.01 * (i % 4)) for i in range(6)]
    rs += [_req(20 + i, "qa", 200, 4.0 + 0.1 * i) for i in range(2)]  # too few alone: judged against the run
    assert outliers(rs) == []
    rs.append(_req(16, "math", 31, 45.6))
    (o,) = outliers(rs)
    assert (o["idx"], o["prompt_id"], o["compared_with"]) == (16, "math-16", "math")
    assert o["expected_s"] == pytest.approx(0.63, abs=0.05)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_stall_watch_bounds_with_a_fake_clock() -> None:
    from sparkllm.bench.stall import StallWatch

    clock = FakeClock()
    w = StallWatch(stall_s=1.0, give_up_s=5.0, clock=clock)
    warm = RequestResult(-1, "p", "c", -1, ok=True, t0=0.0, token_times=[2.0, 2.5])  # first token after 2 s
    w.saw([warm])
    a = RequestResult(0, "p", "c", 0)
    assert w.begin(a, None, streamed=True)
    clock.t += 5.5  # in prefill: up to 3 x the longest first-token wait (6 s) is no stall
    w.check()
    assert w.stalls == [] and w.gave_up is None
    w.token(a)
    clock.t += 0.9
    w.check()
    assert w.stalls == []
    clock.t += 2.1  # decoding: 3 s without a token
    w.check()
    w.token(a)
    assert [round(s["seconds"], 3) for s in w.stalls] == [3.0]
    assert w.problems()[0].startswith("engine stalled 3.0 s during the measured phase (no token")
    # a whole request: the server's generation counter is its sign of progress
    b = RequestResult(1, "p", "c", 0)
    w.end(a)
    w.counter_reading(10.0)
    assert w.begin(b, None, streamed=False)
    clock.t += 0.5
    w.counter_reading(20.0)  # rose: progress, and b is past its prefill
    clock.t += 0.5
    w.counter_reading(20.0)
    w.check()
    assert len(w.stalls) == 1
    clock.t += 5.0
    w.counter_reading(20.0)
    w.check()
    assert w.gave_up is not None and w.gave_up["seconds"] == pytest.approx(5.5)
    c = RequestResult(2, "p", "c", 0)
    assert not w.begin(c, None, streamed=True) and c.error.startswith("not sent: ")
    w.end(b)
    assert not b.ok and b.error.startswith("cut off: ")


@pytest.fixture
def wedge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "engine-wedge"
    monkeypatch.setenv("STANDIN_ENGINE_WEDGE_FILE", str(path))
    yield path
    path.unlink(missing_ok=True)


def _wedge_after(srv: StandinServer, wedge: Path, finished: int, hold: float | None) -> threading.Thread:
    """Wedge the engine once ``finished`` requests have ended; unwedge after ``hold`` s (None: never)."""

    def go() -> None:
        deadline = time.monotonic() + 60
        while srv.engine.finished < finished and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.03)  # inside the next request's decode
        wedge.touch()
        if hold is not None:
            time.sleep(hold)
            wedge.unlink(missing_ok=True)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


def _run(srv: StandinServer, tmp: Path, *extra: str) -> int:
    prompts = write_prompts(tmp / "p.jsonl", n_per_cat=4)
    return bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "x", "--out",
                       str(tmp / "out"), "--prompts", str(prompts), "--max-tokens", "12", "--quiet", *extra])


def test_a_3s_wedge_mid_run_is_a_stall_and_its_request_is_named(
        tmp_path: Path, wedge: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with StandinServer(Config(model="m", step_time=0.01)) as srv:
        th = _wedge_after(srv, wedge, 3, 3.0)
        rc = _run(srv, tmp_path, "--warmup", "0", "--stall-timeout", "1", "--stall-give-up", "30")
        th.join()
    err = capsys.readouterr().err
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    assert rc == 1 and doc["valid"] is False, err
    assert len(doc["requests"]) == 8 and all(r["ok"] for r in doc["requests"])
    (stall,) = [p for p in doc["problems"] if p.startswith("engine stalled ")]
    assert "during the measured phase (no token" in stall and "--stall-timeout 1 s" in stall, stall
    assert doc["stall"]["stalls"][0]["seconds"] >= 2.5
    slow = max(doc["requests"], key=lambda r: r["e2e_s"])
    assert [o["idx"] for o in doc["stall"]["outliers"]] == [slow["idx"]]
    assert any(w.startswith(f"request {slow['idx']} ({slow['prompt_id']}, repeat 0) took ")
               for w in doc["warnings"]), doc["warnings"]
    assert f"warning: run {doc['run_id']}: request {slow['idx']} " in err


def test_a_wedge_under_the_stall_timeout_is_still_named_as_an_outlier(
        tmp_path: Path, wedge: Path) -> None:
    """With the default bounds (30 s) a 3 s wedge is no stall, but its request is named in a warning."""
    with StandinServer(Config(model="m", step_time=0.01)) as srv:
        th = _wedge_after(srv, wedge, 3, 3.0)
        rc = _run(srv, tmp_path, "--warmup", "0")
        th.join()
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    assert rc == 0 and doc["valid"], doc["problems"]
    assert "an outlier" in " ".join(doc["warnings"]) and len(doc["stall"]["outliers"]) == 1


# requests the stand-in ends before the measured phase: decode's continuous-usage probe; records' first pass
@pytest.mark.parametrize(("profile", "warm"), [("decode", 1), ("records", 8)])
def test_an_engine_wedged_for_good_is_given_up_in_one_line(
        tmp_path: Path, wedge: Path, capsys: pytest.CaptureFixture[str], profile: str, warm: int) -> None:
    """records sends whole (non-streamed) requests: no token arrives until the end, so the stall is seen in
    the server's vllm:generation_tokens_total, which stops rising."""
    extra = ["--warmup", "0"] if profile == "decode" else []
    with StandinServer(Config(model="m", step_time=0.01)) as srv:
        _wedge_after(srv, wedge, warm + 3, None)
        t0 = time.monotonic()
        rc = _run(srv, tmp_path, "--profile", profile, "--stall-timeout", "1", "--stall-give-up", "2", *extra)
        took = time.monotonic() - t0
        wedge.unlink()
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("bench.py run: error: engine stalled ") and "gave up after " in lines[0], err
    assert "--stall-give-up 2 s" in lines[0] and "marked partial and invalid" in lines[0], err
    assert took < 60, took  # the bound the runner keeps, not the 600 s per-read timeout
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    n = len(doc["requests"])
    assert doc["valid"] is False and doc["stall"]["gave_up"] is True
    assert 3 <= n < 8 and all(r["ok"] for r in doc["requests"])
    assert doc["problems"][0].endswith(f"gave up after {n} of 8 requests (--stall-give-up 2 s)")
    stored = bench_store.open_store(tmp_path / "out").execute("SELECT valid, requests FROM runs").fetchall()
    assert [tuple(r) for r in stored] == [(0, n)]


def test_bad_stall_bounds_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench.main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x",
                     "--out", str(tmp_path / "o"), "--stall-timeout", "60", "--stall-give-up", "30"])
    err = capsys.readouterr().err
    assert rc == 2 and "need 0 < stall timeout <= give-up" in err and not (tmp_path / "o").exists()
