"""Request-rate mode (issue 23 item 1): seeded Poisson arrivals, goodput against targets, queueing on the
stand-in (a known service time and a limit on requests served at once), store v3, report and CSV."""

from __future__ import annotations

import csv
import json
import sqlite3
import statistics
from pathlib import Path

import bench
import pytest
from sparkllm.bench import analysis as bench_analysis
from sparkllm.bench import rate as bench_rate
from sparkllm.bench import report as bench_report
from sparkllm.bench import store as bench_store

from tests.fixtures.standin_server import Config, StandinServer
from tests.unit.bench_helpers import fake_doc, write_prompts


def _docs(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def test_arrivals_are_seeded_poisson_and_scale_with_the_rate() -> None:
    a = bench_rate.arrivals(2.0, 7, num=4000)
    assert a == bench_rate.arrivals(2.0, 7, num=4000)  # reproducible
    assert a != bench_rate.arrivals(2.0, 8, num=4000)
    gaps = [y - x for x, y in zip([0.0, *a], a, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)  # mean gap 1/rate
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: sd = mean
    fast = bench_rate.arrivals(20.0, 7, num=4000)
    assert all(x == pytest.approx(10 * y, rel=1e-12) for x, y in zip(a, fast, strict=True))
    d = bench_rate.arrivals(5.0, 1, duration=100.0)
    assert max(d) < 100.0 and len(d) == pytest.approx(500, rel=0.15)


def test_goodput_counts_requests_meeting_every_target() -> None:
    rows = [{"ok": True, "ttft_s": 0.5, "tpot_ms": 20.0, "output_tokens": 9},
            {"ok": True, "ttft_s": 2.5, "tpot_ms": 20.0, "output_tokens": 9},  # TTFT too long
            {"ok": True, "ttft_s": 0.5, "tpot_ms": 120.0, "output_tokens": 9},  # TPOT too long
            {"ok": True, "ttft_s": 0.1, "tpot_ms": None, "output_tokens": 1},  # one token: no TPOT
            {"ok": False, "ttft_s": None, "tpot_ms": None}]
    t = bench_rate.parse_goodput("ttft=2s,tpot=100")
    assert t == {"ttft": 2000.0, "tpot": 100.0}
    g = bench_rate.goodput(rows, t, wall_s=4.0)
    assert (g["met"], g["requests"], g["share"], g["rate_req_s"]) == (2, 5, 0.4, 0.5)
    assert bench_rate.goodput(rows, {}, 4.0) is None


@pytest.mark.parametrize(("args", "names"), [
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "1,x"], "--request-rate"),
    (["--request-rate", "1,1"], "--request-rate"),
    (["--request-rate", "1", "--concurrency", "2"], "no concurrency level"),
    (["--request-rate", "1", "--num-requests", "5", "--duration", "3"], "give one of them"),
    (["--request-rate", "1", "--num-requests", "0"], "--num-requests"),
    (["--request-rate", "1", "--duration", "-3"], "--duration"),
    (["--num-requests", "5"], "--request-rate"),
    (["--request-rate", "1", "--goodput", "latency=2s"], "unknown target 'latency'"),
    (["--request-rate", "1", "--goodput", "ttft=fast"], "not a time"),
    (["--request-rate", "1", "--goodput", "ttft=-5ms"], "> 0"),
    (["--request-rate", "1", "--goodput", "ttft"], "NAME=TIME"),
])
def test_bad_rate_input_is_a_usage_error(tmp_path: Path, args: list[str], names: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench.main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x",
                     "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and names in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def _rate_runs(tmp: Path, label: str, cfg: Config, rates: str, n: int) -> list[dict]:
    prompts = write_prompts(tmp / "p.jsonl", n_per_cat=2)
    with StandinServer(cfg) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", label,
                         "--out", str(tmp / "out"), "--prompts", str(prompts), "--max-tokens", "11",
                         "--warmup", "1", "--quiet", "--request-rate", rates, "--num-requests", str(n),
                         "--arrival-seed", "3", "--goodput", "ttft=200ms,tpot=50ms",
                         "--meta-json", json.dumps({"method": label.split("-")[0], "repetition": 1})])
        truth = list(srv.truth)
    assert rc == 0
    return truth


def test_rate_above_capacity_queues_and_goodput_falls(tmp_path: Path) -> None:
    """Known service: one request at a time (max_running 1), 5 ms prefill + 10 decode steps of 5 ms, i.e.
    about 55 ms a request, capacity about 18 req/s. At 4 req/s requests rarely wait; 10 arrivals at
    100 req/s come within about 0.1 s and queue for up to about 0.45 s, so TTFT grows and goodput falls."""
    base = Config(model="m", step_time=0.005, prefill_time=0.005, max_running=1, empty_every=0)
    truth = _rate_runs(tmp_path, "baseline", base, "4,100", 10)
    docs = {d["meta"]["request_rate"]: d for d in _docs(tmp_path / "out")}
    assert set(docs) == {4.0, 100.0} and all(d["valid"] for d in docs.values())
    slow, fast = docs[4.0], docs[100.0]
    for d in (slow, fast):
        assert d["meta"]["concurrency"] is None and d["meta"]["rate"]["arrivals"] == 10
        assert [q["arrival_s"] for q in d["requests"]] == bench_rate.arrivals(
            d["meta"]["request_rate"], 3, num=10)  # the seeded schedule, as sent
        gp = d["summary"]["goodput"]
        assert gp["met"] == sum(1 for q in d["requests"] if q["ttft_s"] <= 0.2 and q["tpot_ms"] <= 50)
        assert gp["met"] == sum(q["meets_targets"] for q in d["requests"])
    # the stand-in's own queueing times; each run: the continuous-usage probe, 1 warm-up, 10 measured
    assert len(truth) == 24
    q_slow = [t.queued_s for t in truth[2:12]]
    q_fast = [t.queued_s for t in truth[14:24]]
    assert max(q_slow) < 0.15 and max(q_fast) > 0.25  # (expected about 0.05 and 0.45 s)
    assert slow["summary"]["goodput"]["share"] >= 0.8  # (expected 1.0)
    assert fast["summary"]["goodput"]["share"] <= 0.6  # (expected about 0.4)
    # the client's TTFT is the server's queueing + prefill (generous: 2-core CI machine)
    client = sorted(q["ttft_s"] for q in fast["requests"])
    server = sorted(x + 0.005 for x in q_fast)
    assert statistics.median(client) == pytest.approx(statistics.median(server), abs=0.08)
    assert fast["summary"]["ttft_s"]["max"] > 0.25
    # open loop: at 100 req/s most requests are in flight at once, and no stranger was seen
    assert fast["meta"]["rate"]["max_in_flight"] >= 5 and slow["meta"]["rate"]["max_in_flight"] <= 3


def test_each_rate_pairs_with_its_baseline_in_store_report_and_csv(tmp_path: Path) -> None:
    base = Config(model="m", step_time=0.005, prefill_time=0.005, max_running=1, empty_every=0)
    mtp = Config(model="m", step_time=0.005, prefill_time=0.005, max_running=1, empty_every=0,
                 spec=True, method="mtp", k=2, pattern=(1,))  # two tokens a step: half the service time
    _rate_runs(tmp_path, "baseline", base, "4,100", 10)
    _rate_runs(tmp_path, "mtp-k2", mtp, "4,100", 10)
    path, stats = bench_report.make_report(tmp_path / "out")
    rows = {m.label: m for m in stats}
    assert set(rows) == {"baseline r=4", "baseline r=100", "mtp-k2 r=4", "mtp-k2 r=100"}
    assert rows["mtp-k2 r=100"].baseline_row == "baseline r=100"
    assert rows["mtp-k2 r=4"].baseline_row == "baseline r=4"
    assert not rows["mtp-k2 r=100"].differs  # same words as the baseline at that rate
    assert rows["mtp-k2 r=100"].rate["goodput_share"] >= rows["baseline r=100"].rate["goodput_share"]
    assert bench_analysis.best_rate_row(stats, 100).base_label == "mtp-k2"
    assert bench_analysis.best_row(stats, 1) is None  # rate rows never stand in for a concurrency level
    md = path.read_text()
    table = md.split("## Request rate")[1].split("\n## ")[0]
    assert "| mtp-k2 r=100 | mtp | 2 | 100 (" in table and "ttft <= 200 ms" in table
    assert "## Load" not in md  # no closed-loop rows
    assert "100 requests/s offered" in md.split("## Recommendation")[1].split("\n## ")[0]
    assert (path.parent / "goodput_vs_rate.png").stat().st_size > 5000
    db = sqlite3.connect(tmp_path / "out" / bench_store.STORE_NAME)
    got = db.execute("SELECT label, request_rate, goodput_share, goodput_targets FROM runs "
                     "ORDER BY label, request_rate").fetchall()
    assert [(r[0], r[1]) for r in got] == [("baseline", 4.0), ("baseline", 100.0), ("mtp-k2", 4.0),
                                           ("mtp-k2", 100.0)]
    assert all(r[2] is not None and json.loads(r[3]) == {"tpot": 50.0, "ttft": 200.0} for r in got)
    assert bench.main(["export", str(tmp_path / "out"), "--csv", "--out", str(tmp_path / "csv")]) == 0
    runs_csv = list(csv.DictReader((tmp_path / "csv" / "runs.csv").open()))
    reqs_csv = list(csv.DictReader((tmp_path / "csv" / "requests.csv").open()))
    assert sorted(float(r["request_rate"]) for r in runs_csv) == [4.0, 4.0, 100.0, 100.0]
    assert all(r["goodput_req_s"] and r["completed_rate_req_s"] for r in runs_csv)
    assert len(reqs_csv) == 40 and all(r["arrival_s"] and r["meets_targets"] in ("0", "1") for r in reqs_csv)


def test_every_depth_request_carries_its_own_cache_salt(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=2)
    with StandinServer(Config(model="m", step_time=0.002)) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "baseline",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--max-tokens", "4",
                         "--warmup", "0", "--quiet", "--depth", "300", "--request-rate", "50",
                         "--num-requests", "6"])
        truth = list(srv.truth)
    assert rc == 0
    (doc,) = _docs(tmp_path / "out")
    measured = truth[-6:]
    assert all(abs(t.prompt_tokens - 300) <= 15 for t in measured)
    salts = [t.cache_salt for t in truth if t.prompt_tokens > 100]  # calibration + measured requests
    assert len(salts) >= 7 and all(salts) and len(set(salts)) == len(salts)
    assert doc["valid"] and doc["meta"]["request_rate"] == 50.0


def test_version_2_store_is_migrated_to_the_current(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / bench_store.STORE_NAME)
    for version, _, sql in bench_store.MIGRATIONS[:2]:
        conn.executescript(sql)
        conn.execute(f"PRAGMA user_version = {version}")
    conn.execute("INSERT INTO runs (run_id, label, valid, problems, doc, input_depth) "
                 "VALUES ('old', 'baseline', 1, '[]', '{}', 512)")
    conn.commit()
    conn.close()
    conn = bench_store.open_store(tmp_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == bench_store.SCHEMA_VERSION == 4
    rows = conn.execute("SELECT run_id, input_depth, request_rate, goodput_share, profile FROM runs")
    assert [tuple(r) for r in rows] == [("old", 512, None, None, None)]
    cols = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
    assert {"arrival_s", "lag_s", "meets_targets", "e2e_tok_s", "turn"} <= cols
    assert [r[0] for r in conn.execute("SELECT version FROM schema ORDER BY version")] == [3, 4]
    assert bench_store.store_run(conn, fake_doc("baseline", 1, [10.0, 11.0]))  # a schema-1 doc still stores
    conn.close()


@pytest.mark.parametrize("text", ["0.5,,1", "1,", ",2"])
def test_a_rate_list_with_an_empty_item_is_refused(text: str) -> None:
    with pytest.raises(bench_rate.UsageError, match="an empty item"):
        bench_rate.rate_list(text)
