"""The readiness wait's phases: classifier on real vLLM start logs, stall rules, serve_wait.py's step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import serve_wait
from sparkllm import serve_phases as sp
from sparkllm.serve_phases import Tracker, check_budgets, classify

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests" / "fixtures" / "vllm_start_logs"
STAMP = re.compile(r"\b(\d\d-\d\d \d\d:\d\d:\d\d)\b")
V0191 = ROOT / ".venv-vllm" / "lib" / "python3.11" / "site-packages" / "vllm"
V0260 = ROOT / ".cache" / "vllm-0.26.0-py" / "vllm"


def _timed(path: Path) -> list[tuple[float, str]]:
    """The log's lines with the time of their vLLM prefix (lines without one inherit the last)."""
    out, ts = [], 0.0
    for line in path.read_text().splitlines():
        m = STAMP.search(line)
        if m:
            ts = datetime.strptime("2026-" + m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        out.append((ts, line))
    return out


def _run(path: Path) -> Tracker:
    lines = _timed(path)
    tr = Tracker(lines[0][0], keep=5)
    for ts, line in lines:
        tr.feed(line, ts)
    tr.finish(lines[-1][0])
    return tr


@pytest.mark.parametrize("name,profile", [("vllm-0.20.0-bf16-base-eager.log", 102),
                                          ("vllm-0.20.0-int4-eager.log", 142)])
def test_real_start_logs_pass_every_phase_in_order_with_their_durations(name, profile):
    tr = _run(LOGS / name)
    phases = [h["phase"] for h in tr.history]
    # eager starts: no CUDA-graph phase; every other phase in start order, then ready
    assert phases == ["start", "engine", "weights", "compile", "kv_cache", "api"]
    assert tr.phase == "ready"
    took = {h["phase"]: h["seconds"] for h in tr.history}
    # the silent profile run after "Model loading took" is the compile phase (92 s / 142 s of no log)
    assert took["compile"] == pytest.approx(profile, abs=1)
    assert took["weights"] <= 2 and took["kv_cache"] <= 1 and took["api"] <= 4
    assert not tr.restarted


def test_a_real_dflash_cuda_graph_start_on_vllm_0_26_0_passes_every_phase_in_order():
    """vLLM 0.26.0, V2 model runner, DFlash drafter, CUDA graphs (tests/gpu/dflash_bench.py on an H200,
    2026-12-02): the capture phase is seen, and the 212 s profile/compile run is the compile phase."""
    tr = _run(LOGS / "vllm-0.26.0-dflash-graph.log")
    phases = [h["phase"] for h in tr.history]
    assert phases == ["start", "engine", "weights", "compile", "kv_cache", "cuda_graphs", "api"]
    assert tr.phase == "ready" and not tr.restarted
    took = {h["phase"]: h["seconds"] for h in tr.history}
    assert took["compile"] == pytest.approx(212, abs=2)
    assert took["cuda_graphs"] == pytest.approx(77, abs=2)  # capture (7 s) and the warm-up after it


def test_a_budget_below_the_silent_profile_run_would_have_stalled_the_real_start():
    """Real 0.20.0 INT4 start: 142 s without a line after the load. With a compile budget of 120 s the
    wait calls it stalled in that phase; with the default (2400 s) it does not."""
    lines = _timed(LOGS / "vllm-0.20.0-int4-eager.log")
    for budget, expect in ((120, True), (None, False)):
        tr = Tracker(lines[0][0], {"compile": budget} if budget else {})
        stalled = []
        for (ts, line), (nxt, _) in zip(lines, lines[1:] + [(lines[-1][0], "")], strict=True):
            tr.feed(line, ts)
            stalled.append((tr.phase, tr.stalled(nxt)))
        assert (("compile", True) in stalled) is expect
        if expect:
            assert all(p == "compile" for p, s in stalled if s)


CUT_LOGS = sorted((ROOT / "tests" / "fixtures" / "vllm_logs").glob("*.txt"))
ORDER = ["start", "engine", "weights", "compile", "kv_cache", "cuda_graphs", "api"]


@pytest.mark.parametrize("path", CUT_LOGS, ids=[p.stem for p in CUT_LOGS])
def test_every_real_cut_start_log_walks_the_phases_in_order_to_ready(path):
    """The real starts of the GPU host (vLLM 0.20.0, H200: eager, CUDA graphs, FlashInfer, fastsafetensors,
    EAGLE-3, first and second starts; tests/fixtures/vllm_logs) through the shipped readiness tracker: every
    phase in start order, CUDA-graph capture seen exactly when the argv has no --enforce-eager, ready at the
    API lines, never taken for a restart."""
    assert len(CUT_LOGS) >= 10
    lines = [(ts, line) for ts, line in _timed(path) if not line.startswith("#")]
    argv = path.read_text().splitlines()[1]
    assert argv.startswith("# argv: vllm serve ")
    tr = Tracker(lines[0][0], keep=5)
    for ts, line in lines:
        tr.feed(line, ts)
    tr.finish(lines[-1][0])
    phases = [h["phase"] for h in tr.history]
    assert phases == [p for p in ORDER if p in phases], phases
    assert {"engine", "weights", "compile", "kv_cache", "api"} <= set(phases)
    assert ("cuda_graphs" in phases) is ("--enforce-eager" not in argv.split())
    assert tr.phase == "ready" and not tr.restarted


CUDA_GRAPH_LINES = [  # the format strings of the phases the eager logs lack (sources cited in serve_phases)
    ("Dynamo bytecode transform time: 12.30 s", "compile"),
    ("Compiling a graph for compile range (1, 8192) takes 41.02 s", "compile"),
    ("Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 2.1 s", "compile"),
    ("torch.compile took 55.10 s in total", "compile"),
    ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 11/11", "cuda_graphs"),
    ("Graph capturing finished in 14 secs, took 0.61 GiB", "cuda_graphs"),
    ("[3/12] /usr/local/cuda/bin/nvcc -c /root/.cache/flashinfer/0.6.6/121a/generated/x.cu", "flashinfer"),
    ("(APIServer pid=1) INFO 12-01 10:00:00 [loggers.py:271] Engine 000: Avg prompt throughput", None),
]


@pytest.mark.parametrize("line,phase", CUDA_GRAPH_LINES)
def test_lines_of_the_compiled_path_are_classified(line, phase):
    assert classify("(EngineCore pid=9) INFO 12-01 10:00:00 [x.py:1] " + line if phase != "flashinfer"
                    else line) == phase


def _source_strings() -> list[str]:
    """The literal part of every pattern that is a vLLM message (not uvicorn's nor ninja's)."""
    lit = []
    for phase, rx in sp.PATTERNS:
        if phase == "flashinfer" or "startup complete" in rx.pattern:
            continue
        lit.append(re.split(r"\\\(v|\\S|\[\\d|\\\.|\\\(p", rx.pattern)[0].replace("\\", ""))
    return lit


@pytest.mark.parametrize("root", [V0191, V0260], ids=["0.19.1", "0.26.0"])
def test_every_pattern_is_a_message_of_both_vllm_releases(root):
    if not root.is_dir():
        pytest.skip(f"{root} not set up (tests/contract/setup_vllm_env.sh)")
    text = "\n".join(p.read_text(errors="replace") for p in root.rglob("*.py") if "/tests/" not in str(p)
                     and p.parts[-2] in ("engine", "worker", "model_loader", "compilation", "core", "openai",
                                          "entrypoints", "gpu"))
    missing = [s for s in _source_strings() if s.strip() not in text]
    assert not missing, missing


def test_flashinfer_side_phase_returns_to_the_main_phase():
    tr = Tracker(0.0)
    tr.feed("x Model loading took 1.0 GiB memory and 2.0 seconds", 10)
    tr.feed("[1/4] /usr/local/cuda/bin/nvcc -o /root/.cache/flashinfer/a.o", 20)
    assert tr.phase == "flashinfer"
    tr.feed("[2/4] /usr/local/cuda/bin/nvcc -o /root/.cache/flashinfer/b.o", 25)
    tr.feed("x torch.compile took 5.00 s in total", 40)
    assert tr.phase == "compile"
    tr.feed("x Available KV cache memory: 41.39 GiB", 50)
    assert [h["phase"] for h in tr.history] == ["start", "compile", "flashinfer", "compile"]
    assert tr.history[2]["seconds"] == 20


def test_a_line_of_an_earlier_phase_never_moves_back_and_a_second_engine_start_is_a_restart():
    tr = Tracker(0.0)
    tr.feed("x Available KV cache memory: 1 GiB", 5)
    tr.feed("x Loading weights took 3.00 seconds", 6)
    assert tr.phase == "kv_cache" and not tr.restarted
    tr.feed("x Initializing a V1 LLM engine (v0.19.1) with config: ...", 7)
    assert tr.restarted


def test_silence_not_phase_length_decides_a_stall_and_the_tail_is_the_phases_own():
    tr = Tracker(0.0, {"weights": 10}, keep=3)
    tr.feed("x Starting to load model /model...", 1)
    for t in range(2, 60, 5):  # a 60 s phase whose log advances every 5 s is not stalled
        tr.feed(f"shard {t}", t)
        assert not tr.stalled(t + 4)
    assert tr.stalled(57 + 11)
    assert list(tr.tail) == ["shard 47", "shard 52", "shard 57"]
    again = Tracker.from_dict(json.loads(json.dumps(tr.to_dict())))
    assert again.to_dict() == tr.to_dict()


@pytest.mark.parametrize("budgets,err", [({"weight": 5}, "unknown phase 'weight'"),
                                         ({"api": 0}, "api=0 must be a positive"),
                                         ({"api": True}, "must be a positive")])
def test_bad_budgets_are_refused_naming_the_phase(budgets, err):
    with pytest.raises(ValueError, match=re.escape(err)):
        check_budgets(budgets)


# --- serve_wait.py's step against fake journalctl/systemctl and a stand-in server -------------------

def _fake_bin(tmp_path: Path, journal: list[dict], state: str = "ActiveState=active\nSubState=running\n"
              "NRestarts=0\nExecMainStatus=0\n") -> Path:
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    (tmp_path / "journal.json").write_text("".join(json.dumps(r) + "\n" for r in journal))
    (tmp_path / "unit.state").write_text(state)
    (b / "journalctl").write_text(  # $6 is --after-cursor after the first call: nothing new
        f"#!/bin/sh\n[ \"$6\" = --after-cursor ] && exit 0\ncat {tmp_path}/journal.json\n")
    (b / "systemctl").write_text(f"#!/bin/sh\ncat {tmp_path}/unit.state\n")
    for f in b.iterdir():
        f.chmod(0o755)
    return b


def _step(tmp_path, bin_dir, argv, state=None):
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "scripts")}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_wait.py"), *argv],
                         input=json.dumps(state), capture_output=True, text=True, env=env, timeout=60)
    return res


def _rec(msg, ts, cur):
    return {"MESSAGE": msg, "__REALTIME_TIMESTAMP": str(int(ts * 1e6)), "__CURSOR": cur, "_PID": "42"}


def test_step_reports_a_stall_with_its_phase_and_last_lines(tmp_path):
    t0 = time.time() - 30
    b = _fake_bin(tmp_path, [_rec("x Initializing a V1 LLM engine (v0.19.1)", t0 + 1, "c1"),
                             _rec("x Starting to load model /model...", t0 + 2, "c2"),
                             _rec("shard 1/4", t0 + 3, "c3"),
                             {"MESSAGE": "Started x.service", "_PID": "1", "__CURSOR": "c4"}])
    argv = ["--unit", "u.service", "--since", str(t0), "--health", "http://127.0.0.1:9/health",
            "--budgets", '{"weights": 5}', "--step", "5", "--poll", "0.1"]
    res = _step(tmp_path, b, argv)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [e["entered"] for e in out["events"]] == ["engine", "weights"]
    res = _step(tmp_path, b, argv, out["state"])
    out = json.loads(res.stdout)
    assert out["status"] == "stalled" and out["phase"] == "weights" and out["budget"] == 5
    assert out["last_lines"] == ["x Starting to load model /model...", "shard 1/4"]
    assert out["silent_seconds"] > 5


def test_step_sees_an_exited_server_at_once(tmp_path):
    b = _fake_bin(tmp_path, [], state="ActiveState=activating\nSubState=auto-restart\nNRestarts=1\n")
    t = time.time()
    res = _step(tmp_path, b, ["--unit", "u", "--since", str(t), "--health", "http://127.0.0.1:9/health",
                              "--step", "20", "--poll", "0.1"])
    assert json.loads(res.stdout)["status"] == "exited"
    assert time.time() - t < 10


def test_step_is_ready_when_health_answers(tmp_path):
    from tests.fixtures.standin_server import StandinServer

    b = _fake_bin(tmp_path, [_rec("x Starting vLLM server on http://127.0.0.1:1", time.time(), "c1")])
    with StandinServer() as srv:
        res = _step(tmp_path, b, ["--unit", "u", "--since", str(time.time() - 3), "--health",
                                  srv.base_url + "/health", "--poll", "0.1"])
    out = json.loads(res.stdout)
    assert out["status"] == "ready" and out["phase"] == "ready"
    assert [h["phase"] for h in out["phases"]] == ["start", "api"]


def test_bad_budgets_exit_2_with_one_line(tmp_path):
    res = _step(tmp_path, tmp_path, ["--unit", "u", "--since", "0", "--health", "http://x/", "--budgets",
                                     '{"nope": 1}'])
    assert res.returncode == 2 and "unknown phase 'nope'" in res.stderr and len(res.stderr.splitlines()) == 1


def test_standin_prints_the_real_phase_lines_in_order(tmp_path):
    env = {**os.environ, "STANDIN_PHASES": "engine=0,weights=0.3,compile=0,kv_cache=0,cuda_graphs=0,api=0",
           "STANDIN_STALL": "cuda_graphs", "STANDIN_TICK": "0.1",
           "PYTHONPATH": str(ROOT / "tests" / "fixtures")}
    p = subprocess.Popen([sys.executable, "-m", "standin_server", "serve", "/m", "--port", "0"], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        tr, seen = Tracker(0.0), []
        for _ in range(8):
            line = p.stdout.readline()
            if tr.feed(line, time.time()):
                seen.append(tr.phase)
            if tr.phase == "cuda_graphs":
                break
        assert seen == ["engine", "weights", "compile", "kv_cache", "cuda_graphs"]
        time.sleep(0.5)
        assert p.poll() is None  # stalled: alive, silent, never serving
    finally:
        p.kill()
        p.wait()
    assert serve_wait.build_parser().parse_args(["--unit", "u", "--since", "1", "--health", "h"]).step == 20
