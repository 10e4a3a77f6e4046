"""The bench stage measured the stand-in server and its results reached the controller."""

import json
import os
import sqlite3
from pathlib import Path

RESULTS = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "results"


def _runs():
    """The cell's runs, the single-stream one at depth 0 first."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    return sorted(runs, key=lambda r: r["meta"]["started_utc"])


def test_one_cell_fetched_despite_two_converges():
    runs = _runs()
    assert len(runs) == 4, "one run per (depth, concurrency); an idempotent rerun must not measure again"
    levels = sorted((r["meta"]["input_depth"] or 0, r["meta"]["concurrency"]) for r in runs)
    assert levels == [(0, 1), (0, 2), (512, 1), (512, 2)]


def test_depth_reached_within_tolerance():
    deep = [r for r in _runs() if r["meta"]["input_depth"]]
    for r in deep:
        assert abs(r["summary"]["prompt_tokens"]["median"] - 512) <= 0.05 * 512
        assert r["meta"]["depth"]["outside_tolerance"] == 0


def test_load_rows_in_the_report():
    report = (RESULTS / "report" / "report.md").read_text()
    assert "## Load" in report and "mtp-k2 c=2 d=512" in report and "## Context depth" in report
    assert "tok_s_vs_concurrency.png" in report


def test_run_is_valid_and_measures_speculation():
    run = _runs()[0]
    assert run["valid"], run["problems"]
    assert run["label"] == "mtp-k2"
    assert run["summary"]["decode_tok_s"]["median"] > 0
    spec = run["spec"]
    assert len(spec["per_position"]) == 2
    # stand-in ground truth: conditional acceptance 0.8 then 0.5 -> p0 ~ 0.8, p1 ~ 0.4
    assert 0.6 < spec["per_position"][0] < 0.95
    assert spec["per_position"][1] < spec["per_position"][0]
    assert 1.0 < spec["mean_acceptance_length"] < 3.0


def test_run_records_what_was_served():
    meta = _runs()[0]["meta"]
    assert meta["method"] == "mtp"
    assert meta["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert "--speculative-config" in meta["serve_argv"]
    assert meta["topology"]["tensor_parallel_size"] in (1, "1")
    assert meta["config_hash"]


def test_url_came_from_the_serve_fact_not_loopback(host):
    """The stand-in answers only on the LAN address in the serve fact, and only with the key."""
    fact = json.loads(host.file("/etc/ansible/facts.d/spark_serve.fact").content_string)
    meta = _runs()[0]["meta"]
    assert meta["base_url"] == f"http://{fact['host']}:{fact['port']}"
    assert not fact["host"].startswith("127.")
    assert meta["server_models"] == ["qwen3.5-122b"]  # /v1/models answered: the key was sent
    assert host.run("curl -sf --max-time 5 http://127.0.0.1:8011/health").rc != 0
    assert "sk-molecule-bench-KEY-51c2" not in json.dumps(_runs()[0])


def test_store_holds_the_run_once():
    with sqlite3.connect(RESULTS / "results.sqlite") as db:
        rows = db.execute("SELECT label, valid FROM runs").fetchall()
    assert rows == [("mtp-k2", 1)] * 4


def test_report_was_written_with_the_method():
    report = (RESULTS / "report" / "report.md").read_text()
    assert "mtp-k2" in report
    assert list((RESULTS / "report").glob("*.png"))


def test_fact_remembers_the_cell(host):
    fact = json.loads(host.file("/etc/ansible/facts.d/spark_bench.fact").content_string)
    (run_id,) = fact["cells"].values()
    assert run_id in {r["run_id"] for r in _runs()}


def test_controller_store_prevents_remeasuring_after_a_wipe(host):
    """A fresh host (no local fact) with the same configuration finds the run in the controller's store."""
    from playbook_runner import run_playbook

    host.run("rm -f /etc/ansible/facts.d/spark_bench.fact")
    res = run_playbook("playbooks/bench.yml")
    assert res.rc == 0, res.output[-3000:]
    assert "already measured" in res.output
    assert len(_runs()) == 4
