"""tests/gpu/e2e.py's Record: the one summary.json writer of every GPU-host script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

e2e = pytest.importorskip("tests.gpu.e2e")  # yaml, numpy: both in the test venv


def test_checks_failures_and_the_summary_on_disk(tmp_path: Path) -> None:
    lines: list[str] = []
    rec = e2e.Record(tmp_path / "out", tmp_path / "work", lines.append, cases={})
    assert (tmp_path / "out").is_dir() and (tmp_path / "work").is_dir()
    rec.check("first", True, {"n": 1})
    rec.check("second", False, "x" * 1000)
    rec.summary["cases"]["base"] = {"ok": True}
    rec.save()
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert doc["failed"] == ["second"] == rec.failures
    assert doc["checks"] == {"first": {"ok": True, "detail": {"n": 1}},
                             "second": {"ok": False, "detail": "x" * 1000}}
    assert doc["cases"] == {"base": {"ok": True}} and doc["seconds"] >= 0
    assert lines[0] == 'PASS first: {"n": 1}' and lines[1].startswith("FAIL second: ") and len(lines[1]) < 620


def test_host_versions_reach_the_summary_with_the_date(tmp_path: Path, monkeypatch) -> None:
    rec = e2e.Record(tmp_path, tmp_path, lambda _m: None)
    monkeypatch.setattr(e2e, "host_versions", lambda prog: None)
    assert rec.host("x.py") is None and rec.summary["host"] == {}
    got = {"vllm": "0.26.0", "torch": "2.11.0", "gpu": "NVIDIA H200", "site": "/s"}
    monkeypatch.setattr(e2e, "host_versions", lambda prog: got)
    assert rec.host("x.py") is got
    assert set(rec.summary["host"]) == {"vllm", "torch", "gpu", "date"}
    assert rec.summary["host"]["vllm"] == "0.26.0"


def test_each_scripts_lines_carry_its_own_name(capsys) -> None:
    # a console holding several scripts' runs must say which script wrote a line
    e2e.logger("dflash_bench")("PASS x")
    e2e.log("PASS y")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[dflash_bench ") and out[0].endswith("] PASS x")
    assert out[1].startswith("[e2e ") and out[1].endswith("] PASS y")


def test_a_command_past_its_timeout_is_a_failed_result_not_a_traceback() -> None:
    # a bench run that outruns the call's budget must become a failed check; the summary is still saved
    import sys
    r = e2e.run([sys.executable, "-c", "import sys, time; print('so far', flush=True); "
                 "print('warn', file=sys.stderr, flush=True); time.sleep(30)"], timeout=1)
    assert r.returncode == e2e.TIMED_OUT == 124
    assert r.stdout == "so far\n"
    assert r.stderr.startswith("warn\n") and "stopped after its 1 s timeout" in r.stderr
    ok = e2e.run([sys.executable, "-c", "print(2)"], timeout=30)
    assert (ok.returncode, ok.stdout) == (0, "2\n")
