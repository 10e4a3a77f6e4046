"""The real start logs kept in tests/fixtures/vllm_logs/ (H200, vLLM 0.20.0, 2026-12-01) against the
phase lines tests/gpu/first_start.py looks for: each fixture names its origin, its phases appear in
start order, a CUDA-graph start shows the capture phase and an eager one does not, and the FlashInfer
and fastsafetensors starts show their backend and loader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
first_start = pytest.importorskip("tests.gpu.first_start")  # imports e2e (yaml, numpy): both in the test venv

FIXTURES = sorted((ROOT / "tests" / "fixtures" / "vllm_logs").glob("vllm-0.20.0-h200-*.txt"))


def phases_in_order(text: str) -> list[str]:
    """Phase names by the line of their first appearance."""
    first: dict[str, int] = {}
    for i, line in enumerate(text.splitlines()):
        for name, rx in first_start.PHASE_RE:
            if name not in first and rx.search(line):
                first[name] = i
    return sorted(first, key=first.get)


def test_fixtures_exist():
    assert len(FIXTURES) >= 8


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_fixture_header_and_phase_order(path):
    text = path.read_text()
    head = text.splitlines()[0]
    assert head.startswith("# sparkllm fixture") and "NVIDIA H200" in head and "vLLM 0.20.0" in head
    assert "2026-12-01" in head and text.splitlines()[1].startswith("# argv: vllm serve ")
    order = phases_in_order(text)
    expected = [n for n, _ in first_start.PHASES if n in order]
    assert order == expected, f"phases out of start order: {order}"
    assert order[:3] == ["engine_core", "load_start", "weights_loading"]
    argv = text.splitlines()[1]
    ready_in_run = "ready (/health 200)" in head
    assert ready_in_run or "not yet healthy at our deadline" in head
    if "api_ready" in order:
        assert order[-2:] == ["engine_ready", "api_ready"]
        if "--enforce-eager" in argv:
            assert "graph_capture" not in order and "Cudagraph is disabled" in text
        else:
            assert {"compile_start", "graph_capture", "graph_capture_done"} <= set(order)
            assert first_start.figures(text)["graph_capture_s"]
    else:
        assert not ready_in_run
    if "--attention-backend FLASHINFER" in argv:
        assert re.search(r"Using AttentionBackendEnum\.FLASHINFER backend", text)
    if "--load-format fastsafetensors" in argv:
        assert "Fastsafetensor" in text


def test_spans_of_a_graph_start():
    text = (ROOT / "tests/fixtures/vllm_logs/vllm-0.20.0-h200-graph-base-first-start.txt").read_text()
    seen: dict[str, float] = {}
    for i, line in enumerate(text.splitlines()):
        first_start.phase_times(line, seen, float(i))
    spans = first_start.phase_spans(seen)
    assert spans["graph_capture"] is not None and spans["graph_capture"] > 0
    assert spans["load"] is not None and spans["load"] >= 0
