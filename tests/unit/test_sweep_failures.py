"""sweep.py tells why: failing task and message from ansible-runner's events, artifacts kept, the
default method list from the catalogue's requirements, usage errors exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sweep
from spark_bench import spark_cell_hash

from tests.unit.bench_helpers import fake_doc, run_sweep_cell


def test_real_runner_failure_names_task_and_message_and_keeps_artifacts(tmp_path: Path) -> None:
    site = ("""---
- name: Tiny site
  hosts: all
  gather_facts: false
  tasks:
    - name: Probe that fails but is ignored
      ansible.builtin.command: /bin/false
      ignore_errors: true
      changed_when: false
      tags: [serve]
    - name: Wait for the server
      ansible.builtin.fail:
        msg: "vLLM did not answer on /health within 900 s; journal says: CUDA out of memory"
      tags: [serve]
""")
    cfg, outcome = run_sweep_cell(tmp_path, site)
    assert not outcome.ok and outcome.rc == 2
    assert outcome.failure == ("task 'Wait for the server' failed on localhost: vLLM did not answer on "
                               "/health within 900 s; journal says: CUDA out of memory")
    art = Path(outcome.artifacts or "")
    assert art.parent == tmp_path / "res" / "runner" and art.name.startswith("mtp-k2-rep1-")
    assert "CUDA out of memory" in (art / "stdout").read_text()
    assert not list(art.rglob("extravars"))  # the private data (extra vars) is not kept


def test_events_without_a_failed_task_fall_back_to_the_error_line() -> None:
    assert sweep.failure_from_events([], "PLAY\nERROR! the playbook: site.yml could not be found\n") == \
        "ERROR! the playbook: site.yml could not be found"
    unreachable = [{"event": "runner_on_unreachable",
                    "event_data": {"task": "Gathering Facts", "host": "spark-01",
                                   "res": {"msg": "ssh: connect to host spark-01.lan port 22:\n refused"}}}]
    assert sweep.failure_from_events(unreachable) == (
        "task 'Gathering Facts' unreachable on spark-01: ssh: connect to host spark-01.lan port 22: refused")


def test_sweep_prints_the_reason_and_the_artifacts(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def failing(req: sweep.RunRequest) -> sweep.RunOutcome:
        return sweep.RunOutcome(False, "failed", 2, failure="task 'serve : Switch' failed on spark-01: boom",
                                artifacts=str(req.artifact_dir / req.ident))

    rc = sweep.main(["--methods", "baseline", "--repeats", "1", "--results", str(tmp_path), "--quiet"],
                    runner=failing)
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED baseline rep 1: task 'serve : Switch' failed on spark-01: boom" in out
    assert f"[runner output: {tmp_path / 'runner'}/baseline-rep1-" in out


def settings(**over: object) -> dict:
    s = sweep.load_settings()
    s.update(over)
    return s


def test_default_methods_are_those_whose_requirements_are_met() -> None:
    methods, why = sweep.choose_methods(None, settings())
    assert methods == ["baseline", "ngram", "mtp"]
    assert set(why) == {"eagle3", "dflash"}
    assert "spec_eagle3_drafter" in why["eagle3"] and "vllm_build_methods" in why["dflash"]
    methods, why = sweep.choose_methods(None, settings(spec_eagle3_drafter="org/drafter",
                                                       vllm_build_methods=["dflash"]))
    assert methods == ["baseline", "ngram", "mtp", "eagle3", "dflash"] and why == {}


def test_explicit_method_without_its_drafter_is_a_usage_error(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[sweep.RunRequest] = []
    rc = sweep.main(["--methods", "baseline,eagle3", "--results", str(tmp_path / "r")],
                    runner=lambda req: calls.append(req) or sweep.RunOutcome(True, "successful", 0))
    err = capsys.readouterr().err
    assert rc == 2 and calls == [] and not (tmp_path / "r").exists()
    assert "eagle3" in err and "spec_eagle3_drafter" in err and "Traceback" not in err


def test_default_run_leaves_out_and_names_unmet_methods(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[str] = []

    def runner(req: sweep.RunRequest) -> sweep.RunOutcome:
        ev = req.extravars
        seen.append(ev["spec_method"])
        doc = fake_doc(ev["bench_label"], ev["bench_repetition"], [10.0], method=ev["spec_method"],
                       config_hash=spark_cell_hash(ev["bench_cell"]), run_id=f"r-{len(seen)}")
        Path(ev["bench_results_dir"], f"{doc['run_id']}.json").write_text(json.dumps(doc))
        return sweep.RunOutcome(True, "successful", 0)

    assert sweep.main(["--repeats", "1", "--results", str(tmp_path), "--quiet"], runner=runner) == 0
    err = capsys.readouterr().err
    assert seen == ["baseline", "ngram", "mtp"]
    assert "eagle3: left out" in err and "dflash: left out" in err
    assert (tmp_path / "report" / "report.md").is_file()


@pytest.mark.parametrize(("args", "needle"), [
    (["--extra-vars", "[1]"], "--extra-vars must be a JSON object"),
    (["--extra-vars", "{bad"], "--extra-vars must be a JSON object"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--methods", "medusa"], "unknown method 'medusa'"),
    (["--methods", "mtp,mtp"], "duplicate configurations"),
    (["--inventory", "/nonexistent/inv.yml"], "--inventory /nonexistent/inv.yml: no such file"),
    # every flag range-checked up front, --mtp-k as --k mtp=... is
    (["--mtp-k", "0,2"], "--mtp-k 0,2: every K must be in 1..16"),
    (["--mtp-k", "17"], "--mtp-k 17: every K must be in 1..16"),
    (["--mtp-k", ","], "--mtp-k : every K must be in 1..16"),
    (["--k", "mtp=0,2"], "--k mtp=0,2: every K must be in 1..16"),
    (["--optimise-concurrency", "0"], "--optimise-concurrency 0: must be a concurrency level >= 1"),
    (["--optimise-concurrency", "4", "--concurrency", "1,2"],
     "--optimise-concurrency 4: not one of the measured levels (1,2)"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           args: list[str], needle: str) -> None:
    calls: list[sweep.RunRequest] = []
    rc = sweep.main([*args, "--results", str(tmp_path / "r")],
                    runner=lambda req: calls.append(req) or sweep.RunOutcome(True, "successful", 0))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and calls == []
    assert len(err) == 1 and needle in err[0]
    assert not (tmp_path / "r").exists()


def test_report_never_pools_different_contexts() -> None:
    """Same label but a different concurrency: two rows named by it; speedups pair within a context."""
    from sparkllm.bench import report as bench_report

    def run(label: str, rep: int, speed: float, conc: int, h: str | None) -> bench_report.RunRow:
        doc = fake_doc(label, rep, [speed] * 3, config_hash=h, run_id=f"{label}-{rep}-{conc}")
        doc["meta"]["concurrency"] = conc
        return bench_report.RunRow(doc["run_id"], label, True, [], rep, doc["meta"]["started_utc"], speed,
                                   doc, [speed] * 3, {})

    runs = [run("baseline", r, 10.0, 1, "b1") for r in (1, 2)]
    runs += [run("baseline", r, 40.0, 8, "b8") for r in (1, 2)]
    runs += [run("mtp-k2", r, 20.0, 1, "m1") for r in (1, 2)]
    runs += [run("mtp-k2", r, 60.0, 8, "m8") for r in (1, 2)]
    rows = {m.label: m for m in bench_report.method_table(runs, "baseline")}
    assert set(rows) == {"baseline c=1", "baseline c=8", "mtp-k2 c=1", "mtp-k2 c=8"}
    assert rows["mtp-k2 c=1"].speedup["gmean"] == pytest.approx(2.0)
    assert rows["mtp-k2 c=8"].speedup["gmean"] == pytest.approx(1.5)
    assert rows["mtp-k2 c=8"].baseline_row == "baseline c=8"
    md = bench_report.render_markdown(list(rows.values()), [], "baseline", [])
    assert "## Configurations" in md and '"concurrency": 8' in md
    # no baseline in that context: no speedup, and the report says why
    lone = bench_report.method_table([run("mtp-k2", 1, 20.0, 4, "m4"), *runs[:2]], "baseline")
    m4 = next(m for m in lone if m.base_label == "mtp-k2")
    assert m4.speedup["gmean"] is None and m4.baseline_row is None
    assert "no baseline run in the same context" in bench_report.render_markdown(lone, [], "baseline", [])


def test_report_shows_what_each_row_measured() -> None:
    """The provenance table names the model revision, toolkit commit and image of each row's runs."""
    from sparkllm.bench import report as bench_report

    def run(label: str, rep: int, meta: dict) -> bench_report.RunRow:
        doc = fake_doc(label, rep, [10.0] * 3, config_hash=label, run_id=f"{label}-{rep}")
        doc["meta"].update(meta)
        return bench_report.RunRow(doc["run_id"], label, True, [], rep, doc["meta"]["started_utc"], 10.0,
                                   doc, [10.0] * 3, {})

    sha = "0123456789abcdef0123456789abcdef01234567"
    runs = [run("baseline", 1, {"model_revision": sha, "toolkit_commit": "f" * 40, "image": "img:a"}),
            run("mtp-k2", 1, {"model_revision": sha, "toolkit_commit": None, "image": "img:b"})]
    md = bench_report.render_markdown(bench_report.method_table(runs, "baseline"), [], "baseline", [])
    table = md.split("## Provenance", 1)[1].split("##", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    base = rows["baseline"]
    assert f"`{sha}`" in base and f"`{'f' * 12}`" in base and "`img:a`" in base
    assert rows["mtp-k2"].split("|")[3].strip() == "-"      # no commit recorded: a dash, not "None"
    assert "`img:b`" in rows["mtp-k2"]
