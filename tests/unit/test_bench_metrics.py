"""Every runner metric against the stand-in server's ground truth."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from sparkllm.bench import stats as bench_stats

from tests.fixtures.standin_server import Config
from tests.unit.bench_helpers import run_against

GOLDEN = (math.sqrt(5) - 1) / 2  # 1 + a + a^2 = 2


def test_spec_exact_pattern(tmp_path: Path) -> None:
    # K=2, accepted per step cycles 2,1,0: each request of 13 tokens = 1 + (3+2+1)*2, 6 steps.
    cfg = Config(spec=True, method="mtp", k=2, pattern=(2, 1, 0), step_time=0.02, prefill_time=0.03)
    doc, srv = run_against(cfg, tmp_path, max_tokens=13, meta={"num_speculative_tokens": 2})
    sp, s = doc["spec"], doc["summary"]
    assert doc["valid"], doc["problems"]
    assert sp["num_drafts"] == 6 * 4 and sp["num_draft_tokens"] == 12 * 4 and sp["num_accepted_tokens"] == 24
    assert sp["acceptance_rate"] == pytest.approx(0.5)
    assert sp["mean_acceptance_length"] == pytest.approx(2.0)
    assert sp["per_position"] == pytest.approx([4 / 6, 2 / 6])
    assert sp["conditional"] == pytest.approx([4 / 6, 0.5])
    assert sp["effective_tokens_per_step"] == pytest.approx(13 / 7)
    assert sp["iid_fit_a"] == pytest.approx(GOLDEN, abs=1e-9)
    assert sp["iid_residuals"] == pytest.approx([4 / 6 - GOLDEN, 2 / 6 - GOLDEN**2], abs=1e-9)
    # client side: 12 decode tokens in 6 token-carrying chunks after the first
    assert s["ok"] == 4 and s["output_tokens"] == 52
    assert s["tokens_per_chunk"]["median"] == pytest.approx(2.0)
    assert s["token_weighted"]["tokens_per_chunk"] == pytest.approx(2.0)
    truth = {t.request_no: t for t in srv.truth}
    measured = [r["decode_tok_s"] for r in doc["requests"]]
    true_rates = [t.decode_tok_s for t in sorted(truth.values(), key=lambda t: t.request_no)][-4:]
    for m, t in zip(measured, true_rates, strict=True):
        assert m == pytest.approx(t, rel=0.15)
    r0 = doc["requests"][0]
    assert r0["tpot_ms"] == pytest.approx(1000 / r0["decode_tok_s"])
    assert r0["e2e_s"] == pytest.approx(r0["ttft_s"] + r0["decode_s"])
    assert r0["ttft_s"] >= 0.03
    # warm-up excluded: only the 4 measured requests reach the counters' difference
    assert sp["generation_tokens"] == 52


def test_spec_off_fields_null(tmp_path: Path) -> None:
    doc, _ = run_against(Config(spec=False, step_time=0.005), tmp_path, max_tokens=10)
    sp = doc["spec"]
    assert doc["valid"], doc["problems"]
    for key in ("acceptance_rate", "mean_acceptance_length", "per_position", "conditional", "iid_fit_a",
                "iid_residuals", "num_drafts"):
        assert sp[key] is None, key
    assert sp["effective_tokens_per_step"] == pytest.approx(1.0)  # measured, one token per step
    assert doc["summary"]["tokens_per_chunk"]["median"] == pytest.approx(1.0)
    for cat in doc["categories"].values():
        assert cat["spec"]["acceptance_rate"] is None


def test_variable_draft_length_uses_a_over_d(tmp_path: Path) -> None:
    # ngram-like: K=3 but drafts of 2 then no draft; all drafted tokens accepted.
    cfg = Config(spec=True, method="ngram", k=3, pattern=(3,), draft_lens=(2, 0), step_time=0.005)
    doc, _ = run_against(cfg, tmp_path, max_tokens=9)
    sp = doc["spec"]
    assert sp["acceptance_rate"] == pytest.approx(1.0)  # A/D, not A/(K*N) = 2/3
    assert sp["mean_acceptance_length"] == pytest.approx(3.0)
    assert sp["per_position"] == pytest.approx([1.0, 1.0, 0.0])
    assert sp["effective_tokens_per_step"] == pytest.approx(9 / 5)  # steps without a draft count


def test_per_category_server_diffs_and_engine_sum(tmp_path: Path) -> None:
    cfg = Config(spec=True, k=2, pattern=(2, 1, 0), step_time=0.005, engines=2)
    doc, _ = run_against(cfg, tmp_path, max_tokens=13, repeats=2)
    assert set(doc["categories"]) == {"code", "chat_qa"}
    for cat in doc["categories"].values():
        assert cat["requests"] == 4
        assert cat["spec"]["acceptance_rate"] == pytest.approx(0.5)
        assert cat["spec"]["per_position"] == pytest.approx([4 / 6, 2 / 6])
    assert doc["spec"]["num_accepted_tokens"] == 6 * 8


def test_fallback_without_continuous_usage(tmp_path: Path) -> None:
    cfg = Config(spec=True, k=2, pattern=(2,), step_time=0.005, continuous_usage=False, empty_every=0)
    doc, _ = run_against(cfg, tmp_path, max_tokens=13)
    assert doc["meta"]["continuous_usage_stats"] is False
    assert doc["valid"], doc["problems"]
    assert doc["summary"]["output_tokens"] == 52
    assert doc["summary"]["tokens_per_chunk"]["median"] == pytest.approx(3.0)


def test_empty_content_chunks_still_timed_by_usage(tmp_path: Path) -> None:
    # every 2nd token chunk has empty content: with usage they still count as token chunks
    cfg = Config(spec=False, step_time=0.005, empty_every=2)
    doc, _ = run_against(cfg, tmp_path, max_tokens=11)
    assert all(r["chunks"] == 11 for r in doc["requests"])
    assert doc["summary"]["tokens_per_chunk"]["median"] == pytest.approx(1.0)


def test_describe_and_t_interval() -> None:
    d = bench_stats.describe([1.0, 2.0, 3.0, 4.0, None])
    assert d["n"] == 4 and d["median"] == 2.5 and d["mean"] == 2.5
    assert d["p5"] == pytest.approx(1.15) and d["p95"] == pytest.approx(3.85)
    sd = math.sqrt(5 / 3)
    assert d["ci95_high"] - d["mean"] == pytest.approx(3.182 * sd / 2)
    assert d["cv"] == pytest.approx(sd / 2.5)
    assert bench_stats.describe([])["median"] is None
    assert bench_stats.t975(200) == pytest.approx(1.972, abs=2e-3)


@pytest.mark.parametrize(("tau", "k", "a"), [(2.44, 2, 0.8), (1.0, 3, 0.0), (4.0, 3, 1.0), (1.5, 1, 0.5)])
def test_iid_fit(tau: float, k: int, a: float) -> None:
    assert bench_stats.fit_iid_acceptance(tau, k) == pytest.approx(a, abs=1e-6)
