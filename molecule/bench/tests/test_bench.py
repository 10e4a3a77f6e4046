"""The bench stage measured the stand-in server and its results reached the controller."""

import hashlib
import json
import os
import shlex
import sqlite3
from pathlib import Path

RESULTS = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "results"


def _runs():
    """The cell's runs, the single-stream one at depth 0 first."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    return sorted(runs, key=lambda r: r["meta"]["started_utc"])


def test_one_cell_fetched_despite_two_converges():
    runs = _runs()
    assert len(runs) == 8, "one run per (depth, concurrency or rate); a rerun must not measure again"
    levels = sorted((m["input_depth"] or 0, m["concurrency"] or 0, m["request_rate"] or 0)
                    for m in (r["meta"] for r in runs))
    assert levels == [(0, 0, 2.0), (0, 0, 20.0), (0, 1, 0), (0, 2, 0),
                      (512, 0, 2.0), (512, 0, 20.0), (512, 1, 0), (512, 2, 0)]


def test_rate_runs_have_their_schedule_and_goodput():
    rated = [r for r in _runs() if r["meta"]["request_rate"]]
    assert len(rated) == 4
    for r in rated:
        assert r["valid"], r["problems"]
        assert r["meta"]["rate"]["arrivals"] == 6 and r["meta"]["concurrency"] is None
        assert r["meta"]["goodput_targets_ms"] == {"ttft": 500.0, "tpot": 50.0}
        gp = r["summary"]["goodput"]
        assert gp["requests"] == 6 and gp["met"] == sum(q["meets_targets"] for q in r["requests"])
    # one seed: the same arrival schedule at every depth, and 20/s is the 2/s schedule ten times faster
    by = {(r["meta"]["input_depth"] or 0, r["meta"]["request_rate"]): [q["arrival_s"] for q in r["requests"]]
          for r in rated}
    assert by[(0, 2.0)] == by[(512, 2.0)]
    assert all(abs(a - 10 * b) < 1e-9 for a, b in zip(by[(0, 2.0)], by[(0, 20.0)], strict=True))
    report = (RESULTS / "report" / "report.md").read_text()
    assert "## Request rate" in report and "mtp-k2 r=20 d=512" in report
    assert "goodput_vs_rate.png" in report


def test_depth_reached_within_tolerance_from_the_owners_text():
    deep = [r for r in _runs() if r["meta"]["input_depth"]]
    readme = Path(__file__).resolve().parents[3] / "README.md"  # bench_depth_text_file in host_vars
    sha = hashlib.sha256(readme.read_bytes()).hexdigest()
    assert len(deep) == 4
    for r in deep:
        assert abs(r["summary"]["prompt_tokens"]["median"] - 512) <= 0.05 * 512
        assert r["meta"]["depth"]["outside_tolerance"] == 0
        filler = r["meta"]["depth"]
        assert filler["filler_sha256"] == sha and filler["filler_source"] == "depth.txt"
    report = (RESULTS / "report" / "report.md").read_text()
    assert f"own text {sha[:12]}" in report.split("## Context depth")[1]


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
    # the project's default INT8 LM head (group_vars/all/main.yml): the outputs check pairs runs by it
    assert meta["lm_head_int8"] in (True, "True")
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
    assert rows == [("mtp-k2", 1)] * 8


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
    assert len(_runs()) == 8


def test_report_says_the_outputs_were_not_checked():
    """No run labelled baseline in this store: every recommendation row says so and names the fix."""
    report = (RESULTS / "report" / "report.md").read_text()
    rec = report.split("## Recommendation")[1].split("\n## ")[0]
    rows = [ln for ln in rec.splitlines() if ln.startswith("- **")]
    assert rows and all("outputs not checked" in ln for ln in rows), rec
    assert "make deploy SPEC_METHOD=baseline" in rec


def test_single_method_deploy_compares_with_an_earlier_baseline(host, tmp_path):
    """A store (its own: the scenario's store and remote directory stay as they are) holding a baseline
    run recorded earlier on this host for the same checkpoint and prompts: the deploy's bench stage
    reports its outputs compared with that run."""
    from playbook_runner import run_playbook

    store = tmp_path / "results"
    store.mkdir()
    earlier = next(r for r in _runs() if r["meta"]["concurrency"] == 1 and not r["meta"]["input_depth"])
    base = json.loads(json.dumps(earlier))
    base.update(run_id="0000-earlier-baseline", label="baseline")
    base["meta"].update(method="baseline", started_utc="2000-01-01T00:00:00.000000Z")
    (store / "0000-earlier-baseline.json").write_text(json.dumps(base))
    fact = "/etc/ansible/facts.d/spark_bench.fact"
    saved = host.file(fact).content_string if host.file(fact).exists else None
    try:
        res = run_playbook("playbooks/bench.yml", {
            "bench_results_dir": str(store), "bench_remote_dir": "/var/lib/sparkllm/results-verdict",
            "bench_concurrency": "1", "bench_depth": "0", "bench_request_rate": "",
            "bench_depth_text_file": ""})
    finally:
        host.run("rm -rf /var/lib/sparkllm/results-verdict")
        host.run(f"printf '%s' {shlex.quote(saved)} > {fact}" if saved is not None else f"rm -f {fact}")
    assert res.rc == 0, res.output[-3000:]
    said = "outputs of mtp-k2: same as baseline: compared with baseline (runs 0000-earlier-baseline"
    assert said in " ".join(res.output.split()), res.output[-3000:]  # the yaml callback folds long lines
    with sqlite3.connect(RESULTS / "results.sqlite") as db:  # the scenario's own store is untouched
        assert db.execute("SELECT count(*) FROM runs WHERE label = 'baseline'").fetchone() == (0,)
