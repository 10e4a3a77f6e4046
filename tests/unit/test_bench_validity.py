"""Validity checks: each injected fault marks the run invalid with a reason."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.standin_server import Config
from tests.unit.bench_helpers import run_against


def test_clean_run_is_valid(tmp_path: Path) -> None:
    doc, _ = run_against(Config(spec=True, k=2, step_time=0.005), tmp_path)
    assert doc["valid"] is True and doc["problems"] == []


def test_restart_mid_run(tmp_path: Path) -> None:
    # probe (1) + warm-up (1) + 2 measured requests, then the counters reset
    doc, _ = run_against(Config(spec=True, k=2, step_time=0.005, restart_after=4), tmp_path)
    assert doc["valid"] is False
    assert any("restarted" in p for p in doc["problems"]), doc["problems"]


def test_token_mismatch(tmp_path: Path) -> None:
    doc, _ = run_against(Config(step_time=0.002, drop_tokens=2), tmp_path, max_tokens=13)
    assert doc["valid"] is False
    assert any("token mismatch" in p for p in doc["problems"]), doc["problems"]


def test_errors(tmp_path: Path) -> None:
    doc, _ = run_against(Config(step_time=0.002, error_every=3), tmp_path)
    assert doc["valid"] is False
    assert doc["summary"]["errors"] >= 1
    assert any("failed" in p for p in doc["problems"])
    assert any("HTTP 500" in e for e in doc["errors_sample"])


def test_preemptions(tmp_path: Path) -> None:
    doc, _ = run_against(Config(step_time=0.002, preempt_every=3), tmp_path)
    assert doc["valid"] is False
    assert any("preemption" in p for p in doc["problems"])


def test_too_many_running_requests(tmp_path: Path) -> None:
    cfg = Config(step_time=0.01, extra_running=2)
    doc, _ = run_against(cfg, tmp_path, max_tokens=20, sample_interval=0.02)
    assert doc["valid"] is False
    assert doc["meta"]["max_running_sampled"] >= 3
    assert any("running on the server" in p for p in doc["problems"])


def test_concurrency_respected_is_valid(tmp_path: Path) -> None:
    doc, _ = run_against(Config(step_time=0.01), tmp_path, concurrency=4, max_tokens=20, sample_interval=0.02)
    assert doc["valid"], doc["problems"]
    assert doc["meta"]["max_running_sampled"] <= 4
