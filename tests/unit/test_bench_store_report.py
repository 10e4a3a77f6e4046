"""SQLite store (schema version, idempotent import), end-to-end CLI run, report tables and charts."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import statistics
from pathlib import Path

import bench
import pytest
from sparkllm.bench import report as bench_report
from sparkllm.bench import store as bench_store

from tests.fixtures.standin_server import Config, StandinServer
from tests.unit.bench_helpers import fake_doc, write_prompts


def test_cli_run_writes_json_and_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl")
    meta = {"repetition": 2, "config_hash": "abc", "speculative_config": {"method": "mtp",
                                                                         "num_speculative_tokens": 2}}
    with StandinServer(Config(spec=True, k=2, step_time=0.002, model="qwen")) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "qwen", "--label", "mtp-k2",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--max-tokens", "9",
                         "--warmup", "1", "--quiet", "--meta-json", json.dumps(meta), "--thinking", "off"])
    assert rc == 0
    files = list((tmp_path / "out").glob("*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    for key in ("label", "valid", "problems", "summary", "spec", "meta"):
        assert key in doc
    for key in ("median", "p5", "p95", "mean"):
        assert doc["summary"]["decode_tok_s"][key] is not None
    m = doc["meta"]
    assert m["server_version"] == {"version": "0.19.1"} and m["model"] == "qwen"
    assert m["sampling"] == {"max_tokens": 9, "temperature": 0.0, "seed": 0, "thinking": "off",
                             "stream": True}
    assert len(m["prompts"]["sha256"]) == 64 and m["repetition"] == 2 and m["config_hash"] == "abc"
    assert m["method"] == "mtp" and "gpu" in m and m["started_utc"].endswith("Z")
    conn = sqlite3.connect(tmp_path / "out" / bench_store.STORE_NAME)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == bench_store.SCHEMA_VERSION
    versions = [(v,) for v in range(1, bench_store.SCHEMA_VERSION + 1)]
    assert conn.execute("SELECT version FROM schema").fetchall() == versions
    run = conn.execute("SELECT label, repetition, config_hash, valid FROM runs").fetchall()
    assert run == [("mtp-k2", 2, "abc", 1)]
    assert conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 4
    assert "decode tok/s median" in capsys.readouterr().out


def test_store_refuses_newer_schema(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / bench_store.STORE_NAME)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(SystemExit, match="newer"):
        bench_store.open_store(tmp_path)


def test_migrate_is_idempotent(tmp_path: Path) -> None:
    conn = bench_store.open_store(tmp_path)
    assert bench_store.migrate(conn) == bench_store.SCHEMA_VERSION
    assert conn.execute("SELECT COUNT(*) FROM schema").fetchone()[0] == bench_store.SCHEMA_VERSION


def test_import_idempotent(tmp_path: Path) -> None:
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    for rep in (1, 2):
        (fetched / f"r{rep}.json").write_text(json.dumps(fake_doc("baseline", rep, [10.0, 11.0])))
    (fetched / "not-a-run.json").write_text("{}")
    store = tmp_path / "results"
    assert bench_store.import_runs([fetched], store) == (2, 0)
    assert bench_store.import_runs([fetched], store) == (0, 2)
    assert bench.main(["import", str(fetched), "--store", str(store)]) == 0
    conn = sqlite3.connect(store / bench_store.STORE_NAME)
    assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 2
    assert conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 4
    assert sorted(p.name for p in store.glob("*.json")) == ["2026-baseline-1.json", "2026-baseline-2.json"]


def _row(md: str, label: str) -> list[str]:
    for line in md.splitlines():
        if line.startswith(f"| {label} |"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row for {label}")


def test_report_from_several_runs(tmp_path: Path) -> None:
    store = tmp_path / "results"
    base = {1: [10.0, 12.0, 14.0], 2: [10.0, 10.0, 10.0], 3: [11.0, 11.0, 11.0]}
    mtp = {1: [15.0, 18.0, 21.0], 2: [12.0, 12.0, 12.0], 3: [16.5, 16.5, 16.5]}
    docs = [fake_doc("baseline", r, v) for r, v in base.items()]
    docs += [fake_doc("mtp-k2", r, v, per_position=[0.8, 0.6], method="mtp") for r, v in mtp.items()]
    docs.append(fake_doc("mtp-k2", 4, [99.0], valid=False, run_id="bad-run"))
    conn = bench_store.open_store(store)
    for d in docs:
        assert bench_store.store_run(conn, d)
    conn.close()
    out = tmp_path / "report"
    assert bench.main(["report", str(store), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    b, m = _row(md, "baseline"), _row(md, "mtp-k2")
    assert b[1] == "3" and b[2] == "9" and b[3] == "11.00"  # pooled median of the 9 requests
    assert m[3] == "16.50" and m[4] == "12.00-19.80"  # median, p5-p95 of pooled requests
    # paired ratios by repetition: 18/12, 12/10, 16.5/11 -> geometric mean
    g = math.exp((math.log(1.5) + math.log(1.2) + math.log(1.5)) / 3)
    assert m[8].startswith(f"{g:.3f}x [") and "(n=3)" in m[8]
    assert b[8] == "1 (reference)"
    assert m[7] == "19.80 / 21.00" and m[11] == "0.80/0.60" and m[10] == "2.40"
    # the latency table pools the row's requests: TPOT p50 / p95 / p99 of 100/d over mtp's nine requests
    # (statistics' inclusive quantiles: linear interpolation, computed here independently of bench_stats)
    tpot = [100.0 / d for v in mtp.values() for d in v]
    q = statistics.quantiles(tpot, n=100, method="inclusive")
    lat = next(r for r in md.split("## Latency")[1].splitlines() if r.startswith("| mtp-k2 |")).split(" | ")
    assert lat[1] == "0.100 / 0.100 / 0.100"  # TTFT s
    assert lat[2] == f"{statistics.median(tpot):.2f} / {q[94]:.2f} / {q[98]:.2f}"
    assert q[98] > statistics.median(tpot)  # a spread: a median shown as p99 would fail
    assert "99.00" not in md.split("## Invalid runs")[0]  # invalid run excluded
    assert "bad-run" in md.split("## Invalid runs")[1]
    assert re.search(r"\| code \| 10\.50 \| 15\.75 \(1\.50x\) \|", md), md
    for png in ("decode_tok_s.png", "acceptance_by_position.png", "speedup_by_category.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        assert f"]({png})" in md


def test_pairing_by_closest_timestamp() -> None:
    def row(label: str, ts: str, med: float) -> bench_report.RunRow:
        return bench_report.RunRow(f"{label}{ts}", label, True, [], None, f"2026-01-01T00:{ts}:00.000000Z",
                                   med, {}, [], {})
    base = [row("b", "00", 10), row("b", "10", 20)]
    meth = [row("m", "11", 30), row("m", "01", 12)]
    pairs = bench_report.pair_runs(meth, base)
    assert [(m.median, b.median) for m, b in pairs] == [(30, 20), (12, 10)]


def test_report_without_store_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no results store"):
        bench_report.make_report(tmp_path)


def test_lookup_finds_only_valid_runs_of_the_same_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "results"
    assert bench.main(["lookup", "--store", str(store), "--config-hash", "h1", "--repetition", "0"]) == 1
    assert not store.exists(), "a lookup must not create a store"
    good = fake_doc("mtp-k2", 0, [10.0])
    good["meta"]["config_hash"] = "h1"
    bad = fake_doc("mtp-k2", 1, [10.0])
    bad["meta"]["config_hash"] = "h1"
    bad["run_id"] += "-bad"
    bad["valid"], bad["problems"] = False, ["token mismatch"]
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text(json.dumps(good))
    (src / "b.json").write_text(json.dumps(bad))
    bench_store.import_runs([src], store)
    capsys.readouterr()
    assert bench.main(["lookup", "--store", str(store), "--config-hash", "h1", "--repetition", "0"]) == 0
    assert capsys.readouterr().out.strip() == good["run_id"]
    assert bench.main(["lookup", "--store", str(store), "--config-hash", "h1", "--repetition", "1"]) == 1
    assert bench.main(["lookup", "--store", str(store), "--config-hash", "h2", "--repetition", "0"]) == 1
