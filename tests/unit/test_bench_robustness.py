"""The benchmark's robustness (issue 46 items 3, 9 and 12): an output place that cannot be written is
refused before anything is measured; Ctrl-C and SIGTERM keep what was measured; a URL ending in /v1 and
values that mean nothing are handled clearly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import bench
import pytest
import sweep
from sparkllm.bench import store as bench_store

from tests.fixtures.standin_server import Config, StandinServer
from tests.unit.bench_helpers import fake_doc, write_prompts

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Path]:
    """A directory no file can be created in, for root too (chattr +i, as on an immutable or read-only
    mount); chmod 555 for another user."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
    elif subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a directory unwritable here (chattr +i needs CAP_LINUX_IMMUTABLE)")
    yield d
    subprocess.run(["chattr", "-i", str(d)], capture_output=True)
    d.chmod(0o755)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("sub", ["", "results"])
def test_run_into_an_unwritable_out_is_refused_before_any_request(
        tmp_path: Path, unwritable: Path, sub: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It measured everything, then lost the run ([Errno 30], exit 1)."""
    out = unwritable / sub if sub else unwritable
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=1)
    with StandinServer(Config(model="m", step_time=0.001)) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "x", "--out", str(out),
                         "--prompts", str(prompts), "--max-tokens", "4", "--warmup", "0", "--quiet"])
        asked = srv.engine.request_no
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and asked == 0, line
    assert str(out) in line and "--out cannot be written" in line and "choose a writable directory" in line


def _store(tmp: Path) -> Path:
    store = tmp / "store"
    conn = bench_store.open_store(store)
    bench_store.store_run(conn, fake_doc("baseline", 1, [10.0, 11.0]))
    conn.close()
    return store


@pytest.mark.parametrize("cmd", [["report", "--no-charts"], ["export", "--csv"]])
def test_report_and_export_into_an_unwritable_out_are_usage_errors(
        tmp_path: Path, unwritable: Path, cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    store = _store(tmp_path)
    out = unwritable / "out"
    rc = bench.main([cmd[0], str(store), cmd[1], "--out", str(out)])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and str(out) in line and "--out cannot be written" in line, line


def test_sweep_into_an_unwritable_results_is_a_usage_error_before_any_cell(
        tmp_path: Path, unwritable: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calls = []
    rc = sweep.main(["--methods", "baseline", "--repeats", "1", "--results", str(unwritable / "res"),
                     "--quiet", "--concurrency", "1"], runner=lambda req: calls.append(req))
    err = capsys.readouterr().err
    assert rc == 2 and not calls and "Traceback" not in err
    assert "--results cannot be written" in err and str(unwritable / "res") in err, err


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--concurrency", "1,,2", "--concurrency '1,,2': an empty item"),
    ("--concurrency", "1,", "--concurrency '1,': an empty item"),
    ("--depth", "0,,8192", "--depth '0,,8192': an empty item"),
    ("--temperature", "-1", "--temperature -1: must be 0 (greedy) or more"),
    ("--temperature", "nan", "--temperature nan: must be 0 (greedy) or more"),
])
def test_values_that_mean_nothing_are_refused(tmp_path: Path, flag: str, value: str, needle: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench.main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x",
                     "--out", str(tmp_path / "o"), flag, value])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and needle in line, line
    assert not (tmp_path / "o").exists()


def test_a_base_url_ending_in_v1_is_taken_as_the_server_root(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM serves /metrics at the root, beside /v1 (vllm/entrypoints/serve/instrumentator/metrics.py):
    with the /v1 kept every /metrics read was a 404 and the run invalid without naming the /v1."""
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=1)
    with StandinServer(Config(model="m", step_time=0.001)) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url + "/v1/", "--model", "m", "--label", "x",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--max-tokens", "4",
                         "--warmup", "0", "--quiet"])
    io = capsys.readouterr()
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    assert rc == 0 and doc["valid"], doc["problems"]
    assert doc["meta"]["base_url"] == srv.base_url
    assert io.err.strip() == (f"bench.py run: note: --base-url {srv.base_url}/v1/ ends in /v1; using "
                              f"{srv.base_url} (the bench adds /v1/... and /metrics itself)")


@pytest.mark.parametrize(("sig", "rc"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_keeps_the_requests_measured_as_a_partial_invalid_run(tmp_path: Path, sig: int,
                                                                       rc: int) -> None:
    """Ctrl-C printed a traceback, SIGTERM exited silently, and the requests already measured were lost.
    Now the run is written and stored, marked invalid ("interrupted by SIGINT after N of M requests"), one
    line says so, and the exit code is the shell's for that signal (sparkllm/cli.py: 130, 143)."""
    import time

    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=10)
    out = tmp_path / "out"
    with StandinServer(Config(model="m", step_time=0.02)) as srv:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "bench.py"), "run", "--base-url", srv.base_url, "--model", "m",
             "--label", "x", "--out", str(out), "--prompts", str(prompts), "--max-tokens", "6",
             "--warmup", "0", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(SCRIPTS)},
            # Ctrl-C as a terminal delivers it. A shell without job control starts a background job (`cmd &`
            # in a CI script) with SIGINT ignored, the child inherits that and Python keeps it ignored: the
            # run went on to the end and exited 0 (seen in CI). The child gets the default disposition back.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60  # a wait for the stand-in's progress, not a measurement
        while srv.engine.c.success < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(sig)
        so, se = proc.communicate(timeout=60)
    name = signal.Signals(sig).name
    assert proc.returncode == rc, se
    lines = se.strip().splitlines()
    assert "Traceback" not in se and len(lines) == 1, se
    assert lines[0].startswith(f"bench.py run: interrupted by {name} after ") and "written" in lines[0], se
    (doc,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    n = len(doc["requests"])
    assert 3 <= n < 20 and all(r["ok"] for r in doc["requests"])  # the 4th may still be read at the signal
    assert doc["valid"] is False and doc["problems"][0] == f"interrupted by {name} after {n} of 20 requests"
    assert doc["meta"]["interrupted"] == {"signal": name, "measured": n, "planned": 20}
    stored = bench_store.open_store(out).execute("SELECT valid, requests FROM runs").fetchall()
    assert [tuple(r) for r in stored] == [(0, n)]
