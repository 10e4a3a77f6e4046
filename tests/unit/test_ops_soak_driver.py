"""The ops soak's load driver (molecule/ops/files/soak.py) against the stand-in server: its accounting of
completed, cancelled and lost requests is checked against the stand-in's own record of what it served."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.standin_server import server

SOAK = Path(__file__).resolve().parents[2] / "molecule" / "ops" / "files" / "soak.py"
_spec = importlib.util.spec_from_file_location("ops_soak", SOAK)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def _run(url: str, tmp_path: Path, *extra: str, key: str = "sk-soak") -> tuple[subprocess.CompletedProcess,
                                                                               dict]:
    (tmp_path / "key").write_text(key + "\n")
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(SOAK), url, "m", str(tmp_path / "key"), "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=120, check=False)
    return proc, (json.loads(out.read_text()) if out.exists() else {})


def test_every_request_but_the_cancelled_one_ends_whole_as_the_server_served_it(tmp_path: Path) -> None:
    # max_num_seqs 4 as in the ops scenario; a 1500-word prompt prefilled at 1 ms a token (~1.5 s)
    cfg = server.Config(model="m", api_key="sk-soak", max_running=4, prefill_per_token=0.001)
    with server.StandinServer(cfg) as srv:
        proc, res = _run(srv.base_url, tmp_path, "--duration", "10", "--long-words", "1500",
                         "--burst-tokens", "150")
        truth = list(srv.truth)
        with srv.engine.lock:
            running, waiting = srv.engine.c.running, srv.engine.c.waiting
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (res["cancelled"], res["lost"]) == (1, 0), res["lost_detail"]
    assert res["requests"] == res["completed"] + 1
    # the server finished exactly the completed ones (not the cancelled one), with the tokens counted
    assert len(truth) == res["completed"]
    assert sum(t.tokens for t in truth) == res["tokens"]
    assert res["kinds"]["burst"] == {"completed": 9} and res["kinds"]["long"] == {"completed": 1}
    assert res["kinds"]["cancel"] == {"cancelled": 1} and res["kinds"]["short"]["completed"] >= 10
    # the long prompt: "long:" + 1500 words -> 1502 prompt tokens at the stand-in's 1 token a word + 1
    assert max(t.prompt_tokens for t in truth) == 1502 and res["long_prefill_s"] >= 1.5
    # the burst went above max_num_seqs: some waited for a slot; the cancelled stream gave its slot back
    assert max(t.queued_s for t in truth) > 0.05
    assert (running, waiting) == (0, 0)
    assert "0 lost" in proc.stdout


def test_a_failed_request_is_counted_lost_and_fails_the_soak(tmp_path: Path) -> None:
    cfg = server.Config(model="m", api_key="sk-soak", max_running=4, error_every=5)
    with server.StandinServer(cfg) as srv:
        proc, res = _run(srv.base_url, tmp_path, "--duration", "3", "--long-words", "50",
                         "--burst-tokens", "50")
        served = len(srv.truth)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert res["lost"] >= 1 and all("HTTP Error 500" in r["reason"] for r in res["lost_detail"])
    assert res["completed"] == served
    assert res["requests"] == res["completed"] + res["cancelled"] + res["lost"]


def test_a_wrong_key_loses_every_request(tmp_path: Path) -> None:
    with server.StandinServer(server.Config(model="m", api_key="sk-soak")) as srv:
        proc, res = _run(srv.base_url, tmp_path, "--duration", "1", "--long-words", "10", key="wrong")
    assert proc.returncode == 1
    assert res["completed"] == res["cancelled"] == 0 and res["lost"] == res["requests"] > 0


def _lines(*chunks: dict, done: bool = True) -> list[str]:
    return [f"data: {json.dumps(c)}" for c in chunks] + (["data: [DONE]"] if done else [])


_TEXT = {"choices": [{"delta": {"content": " w1"}, "finish_reason": None}]}
_END = {"choices": [{"delta": {"content": " w2"}, "finish_reason": "length"}]}
_USAGE2 = {"choices": [], "usage": {"completion_tokens": 2}}


@pytest.mark.parametrize(("lines", "status", "reason"), [
    (_lines(_TEXT, _END, _USAGE2), "completed", None),
    (_lines(_TEXT, _END, _USAGE2, done=False), "lost", "without [DONE]"),
    (_lines(_TEXT, _TEXT, _USAGE2), "lost", "no finish_reason"),
    (_lines(_TEXT, _END, {"choices": [], "usage": {"completion_tokens": 1}}), "lost", "1 of 2 tokens"),
    (_lines(_TEXT, _END), "lost", "None of 2 tokens"),
    (["data: {not json"], "lost", "unparsable"),
])
def test_classify_a_stream(lines: list[str], status: str, reason: str | None) -> None:
    rec = soak.classify(lines, 2)
    assert rec["status"] == status
    assert reason is None or reason in rec["reason"]


@pytest.mark.parametrize("args", [["--duration", "0"], ["--max-num-seqs", "-1"], []])
def test_bad_arguments_exit_2_before_any_request(tmp_path: Path, args: list[str]) -> None:
    key = tmp_path / "key" if args else tmp_path / "missing-key"
    if args:
        key.write_text("k\n")
    proc = subprocess.run([sys.executable, str(SOAK), "http://127.0.0.1:9", "m", str(key), "--out",
                           str(tmp_path / "o.json"), *args], capture_output=True, text=True, timeout=30,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "o.json").exists()
    assert "must be positive" in proc.stderr or "cannot read the API key file" in proc.stderr
