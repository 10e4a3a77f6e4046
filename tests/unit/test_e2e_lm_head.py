"""tests/gpu/e2e.py's INT8 LM head checks, fed with log text in the exact format patch 0002 logs.

The format string is taken from patches/src/sparkllm_lm_head_int8.py (the module the patches add),
so a change of the log line that the GPU run's regular expression no longer reads fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.gpu import e2e, tiny_pair

ROOT = Path(__file__).resolve().parents[2]

SOURCE = (ROOT / "patches" / "src" / "sparkllm_lm_head_int8.py").read_text()


def load_line_format() -> str:
    """The %-format of the module's INFO line (adjacent string literals joined)."""
    start = '"sparkllm: lm_head INT8 (per-row)'
    call = SOURCE.split("logger.info(\n        " + start, 1)[1].split("rows, cols", 1)[0]
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', start + call)
    return "".join(parts)


def load_line(model: str, rows: int, kernel: str = "triton") -> str:
    return "INFO 11-30 [sparkllm_lm_head_int8.py:250] " + load_line_format() % (
        rows, 64, model, "lm_head", kernel, 0.00012, 0.031, 0.0042, "bfloat16", 0.1, 0.05)


PROBE = [{"prompt": p, "text": "ab", "tokens": ["a", "b"], "logprobs": [-0.01, -0.02]} for p in e2e.PROMPTS]


def run_check(int8_log: str, mtp_log: str = "", int8_probe=None, counters=None) -> dict:
    summary: dict = {"figures": {}}
    checks: dict = {}

    def check(name, ok, detail):
        checks[name] = bool(ok)

    results = {"hybrid-mtp": PROBE, "hybrid-mtp-int8": int8_probe or PROBE}
    counters = counters or {k: {e2e.DRAFT_TOKENS: 100.0, e2e.ACCEPTED: 97.0}
                            for k in ("hybrid-mtp", "hybrid-mtp-int8")}
    e2e.check_lm_head_int8(check, summary, {"hybrid-mtp-int8": int8_log, "hybrid-mtp": mtp_log},
                           results, counters)
    return {"checks": checks, "figures": summary["figures"]["lm_head_int8"]}


def test_the_module_line_is_read():
    v = tiny_pair.vocab_size()
    text = load_line("Qwen3_5MoeForConditionalGeneration", v) + "\n" + load_line("Qwen3_5MoeMTP", v) + "\n"
    lines = e2e.lm_head_lines(text)
    assert [ln["model"] for ln in lines] == ["Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeMTP"]
    assert lines[0]["rows"] == v and lines[0]["cols"] == 64 and lines[0]["kernel"] == "triton"
    out = run_check(text)
    assert all(out["checks"].values()), out
    assert out["figures"]["vs_hybrid_mtp"]["same_tokens"] == len(e2e.PROMPTS)
    assert out["figures"]["probe_acceptance"] == {"hybrid-mtp": 0.97, "hybrid-mtp-int8": 0.97}


@pytest.mark.parametrize("case", ["no line", "fallback", "cpu kernel", "tokens differ", "low acceptance",
                                  "on without being asked"])
def test_each_failure_is_caught(case):
    v = tiny_pair.vocab_size()
    good = load_line("Qwen3_5MoeForConditionalGeneration", v)
    int8_log, mtp_log, probe, counters = good, "", None, None
    if case == "no line":
        int8_log = "nothing"
    elif case == "fallback":
        int8_log = good + "\nWARNING sparkllm: lm_head INT8 unavailable for X (lm_head): boom; keeping bf16"
    elif case == "cpu kernel":
        int8_log = load_line("Qwen3_5MoeForConditionalGeneration", v, kernel="torch")
    elif case == "tokens differ":
        probe = [dict(p, tokens=["x", "y"]) for p in PROBE[:3]] + PROBE[3:]
    elif case == "low acceptance":
        counters = {"hybrid-mtp": {e2e.DRAFT_TOKENS: 100.0, e2e.ACCEPTED: 99.0},
                    "hybrid-mtp-int8": {e2e.DRAFT_TOKENS: 100.0, e2e.ACCEPTED: 50.0}}
    elif case == "on without being asked":
        mtp_log = good
    out = run_check(int8_log, mtp_log, probe, counters)
    assert not all(out["checks"].values()), (case, out)


def test_a_drafter_copy_falling_back_is_reported_not_failed():
    v = tiny_pair.vocab_size()
    warning = ("WARNING sparkllm: lm_head INT8 unavailable for Qwen3_5MoeMTP (lm_head): ValueError: "
               "non-finite weights in rows 0..383; keeping torch.bfloat16")
    text = load_line("Qwen3_5MoeForConditionalGeneration", v) + "\n" + warning
    assert all(run_check(text)["checks"].values())
