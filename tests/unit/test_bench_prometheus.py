"""Prometheus text parsing: labels as a set, engine sums, exact _total names, restarts."""

from __future__ import annotations

import pytest
from sparkllm.bench import prometheus as bench_prometheus
from sparkllm.bench import runner as bench_runner

TEXT = '''# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:generation_tokens_total{model_name="m",engine="1"} 50.0
vllm:generation_tokens_created{model_name="m",engine="1"} 1.7e9
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",engine="0",model_name="m"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
weird{a="x\\"y,z",b="2"} 1.5 1700000000000
process_start_time_seconds 1.7e9
'''


def test_parse_sums_engines_and_ignores_created() -> None:
    s = bench_prometheus.MetricsSnapshot.parse(TEXT)
    assert s.total("vllm:generation_tokens_total") == 150.0
    assert s.total("vllm:generation_tokens") is None
    assert s.total("vllm:generation_tokens_total", engine="1") == 50.0
    assert s.total("vllm:time_to_first_token_seconds_count") == 5.0
    assert s.total("process_start_time_seconds") == 1.7e9


def test_labels_are_a_set() -> None:
    s = bench_prometheus.MetricsSnapshot.parse(TEXT)
    assert s.by_label(bench_prometheus.M_ACC_POS, "position") == {"0": 8.0, "1": 3.0}
    assert s.total("weird", a='x"y,z') == 1.5


def _snap(gen: float, start: float = 1.0) -> bench_prometheus.MetricsSnapshot:
    return bench_prometheus.MetricsSnapshot.parse(f'vllm:generation_tokens_total{{engine="0"}} {gen}\n'
                                       f"process_start_time_seconds {start}\n")


def test_restart_detection() -> None:
    assert bench_prometheus.restart_problem(_snap(10), _snap(20)) is None
    assert "backwards" in (bench_prometheus.restart_problem(_snap(10), _snap(5)) or "")
    assert "process_start_time_seconds" in (bench_prometheus.restart_problem(_snap(10), _snap(20, 2.0)) or "")


def test_spec_metrics_null_without_spec_counters() -> None:
    sp = bench_runner.spec_metrics(_snap(10), _snap(20))
    assert sp["generation_tokens"] == 10
    assert sp["acceptance_rate"] is None and sp["per_position"] is None
    assert sp["effective_tokens_per_step"] is None  # no histogram counts: not computable


def test_spec_metrics_from_text_diff() -> None:
    def snap(n: int, d: int, a: int, p0: int, p1: int, gen: int, itl: int,
             ttft: int) -> bench_prometheus.MetricsSnapshot:
        return bench_prometheus.MetricsSnapshot.parse("\n".join([
            f'vllm:spec_decode_num_drafts_total{{model_name="m",engine="0"}} {n}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {d}',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {a}',
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} {p0}',
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="1",engine="0"}} {p1}',
            f'vllm:generation_tokens_total{{engine="0"}} {gen}',
            f'vllm:inter_token_latency_seconds_count{{engine="0"}} {itl}',
            f'vllm:time_to_first_token_seconds_count{{engine="0"}} {ttft}']))
    sp = bench_runner.spec_metrics(snap(10, 20, 5, 4, 1, 100, 50, 5),
                                   snap(110, 220, 165, 84, 81, 400, 150, 15))
    assert sp["acceptance_rate"] == pytest.approx(160 / 200)
    assert sp["mean_acceptance_length"] == pytest.approx(2.6)
    assert sp["per_position"] == pytest.approx([0.8, 0.8])
    assert sp["conditional"] == pytest.approx([0.8, 1.0])
    assert sp["effective_tokens_per_step"] == pytest.approx(300 / 110)


class _LaggingEndpoint:
    """/metrics that reaches the final counts only at the third scrape: the last request's
    TTFT observation lands after its tokens were counted (stats recorded after the output)."""

    def __init__(self) -> None:
        self.scrapes = 0

    def metrics(self) -> bench_prometheus.MetricsSnapshot:
        self.scrapes += 1
        ttft = 4 if self.scrapes >= 3 else 3
        return bench_prometheus.MetricsSnapshot.parse(f"vllm:generation_tokens_total 52\n"
                                     f"vllm:time_to_first_token_seconds_count {ttft}\n")


def test_final_scrape_waits_for_every_answered_requests_ttft() -> None:
    before = bench_prometheus.MetricsSnapshot.parse(
        "vllm:generation_tokens_total 0\nvllm:time_to_first_token_seconds_count 0\n")
    ep = _LaggingEndpoint()
    snap = bench_runner._settled_snapshot(ep, 52, before, expect_requests=4)  # type: ignore[arg-type]
    assert snap.total("vllm:time_to_first_token_seconds_count") == 4 and ep.scrapes == 3
    ep = _LaggingEndpoint()  # tokens alone would have stopped at the first scrape
    assert bench_runner._settled_snapshot(ep, 52, before).total("vllm:time_to_first_token_seconds_count") == 3  # type: ignore[arg-type]
