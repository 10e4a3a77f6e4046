"""bench: Prometheus text parsing of vLLM's /metrics (standard library only)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _parse_labels(text: str) -> frozenset[tuple[str, str]]:
    body = text[1:-1] if text else ""
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(body):
        m = _LABEL_RE.match(body, pos)
        if not m:
            break
        value = m.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        out.append((m.group(1), value))
        pos = m.end()
    return frozenset(out)


@dataclass
class MetricsSnapshot:
    """One scrape of /metrics: samples keyed by (name, label set)."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    t_mono: float = 0.0
    ok: bool = True

    @classmethod
    def parse(cls, text: str, t_mono: float = 0.0) -> MetricsSnapshot:
        samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE_RE.match(line)
            if not m:
                continue
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            samples[(m.group(1), _parse_labels(m.group(2) or ""))] = value
        return cls(samples, t_mono)

    def total(self, name: str, **match: str) -> float | None:
        """Sum of every sample named exactly ``name`` whose labels include ``match`` (sums engines)."""
        want = set(match.items())
        vals = [v for (n, labels), v in self.samples.items() if n == name and want <= labels]
        return sum(vals) if vals else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Sum samples of ``name`` grouped by the value of ``label`` (e.g. position)."""
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n != name:
                continue
            for k, lv in labels:
                if k == label:
                    out[lv] = out.get(lv, 0.0) + v
        return out

    def counters(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return {k: v for k, v in self.samples.items() if k[0].endswith(("_total", "_count"))}


M_GEN = "vllm:generation_tokens_total"
M_PREEMPT = "vllm:num_preemptions_total"
M_RUNNING = "vllm:num_requests_running"
M_DRAFTS = "vllm:spec_decode_num_drafts_total"
M_DRAFT_TOK = "vllm:spec_decode_num_draft_tokens_total"
M_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
M_ACC_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
M_TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
M_ITL_COUNT = "vllm:inter_token_latency_seconds_count"
M_START = "process_start_time_seconds"


def restart_problem(before: MetricsSnapshot, after: MetricsSnapshot) -> str | None:
    """Return a reason if the server restarted between two snapshots, else None."""
    s0, s1 = before.total(M_START), after.total(M_START)
    if s0 is not None and s1 is not None and s0 != s1:
        return f"server restarted: process_start_time_seconds changed ({s0:.0f} -> {s1:.0f})"
    after_c = after.counters()
    for key, v0 in before.counters().items():
        v1 = after_c.get(key)
        if v1 is None or v1 < v0:
            return f"server restarted: counter {key[0]} went backwards ({v0:g} -> {v1})"
    return None


def delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str, **match: str) -> float | None:
    a, b = before.total(name, **match), after.total(name, **match)
    return None if a is None or b is None else b - a
