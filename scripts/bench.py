#!/usr/bin/env python3
"""Benchmark runner, results store and report for speculative decoding on an OpenAI/vLLM server.

Subcommands
-----------
``run``           (on the Spark; STANDARD LIBRARY ONLY) stream chat completions, scrape /metrics,
                  write ``DIR/<run-id>.json`` and append to ``DIR/results.sqlite``.
``import``        (controller) merge run JSON files into a store directory, idempotently.
``report``        (controller; matplotlib imported lazily) Markdown report + PNG charts.
``fetch-prompts`` download Spec-Bench ``question.jsonl`` (pinned commit + sha256) and convert it.

Exit codes: 0 success; 1 the work failed (``run``: nothing answers at ``--base-url``, or the run is
invalid: it is still written and stored, marked invalid, and one line on stderr says why, also with
``--quiet``; ``lookup``: no such run); 2 usage error (bad option values, a malformed ``--base-url``,
missing files named on the command line, an output the tool may not write).

Metric definitions follow docs "Measuring speculative decoding honestly": per request, t0 is the
send time and t_1..t_m the arrival times (monotonic clock) of the chunks that carried tokens (with
``continuous_usage_stats``: chunks whose cumulative ``completion_tokens`` grew; otherwise chunks
with content), n the final ``usage.completion_tokens``:
``ttft_s = t_1 - t0``, ``decode_s = t_m - t_1``, ``e2e_s = t_m - t0``,
``decode_tok_s = (n-1)/decode_s``, ``tpot_ms = 1000*decode_s/(n-1)``,
``tokens_per_chunk = (n-1)/(m-1)``, ICL = inter-chunk latencies t_(i+1) - t_i (NOT per token).
Server side (differences of /metrics snapshots, summed over ``engine``): acceptance_rate = A/D,
mean_acceptance_length = 1 + A/N, per_position p_i = A_i/N, conditional c_i = p_i/p_(i-1),
effective_tokens_per_step = d(generation_tokens)/(d(ITL count) + d(TTFT count)), i.i.d. fit of a
in (1 - a^(K+1))/(1 - a) = tau and residuals p_i - a^(i+1).

Results store (SQLite, ``DIR/results.sqlite``), schema version 1 (``PRAGMA user_version`` and
table ``schema``; see docs/results-store.md)::

    schema(version INTEGER PRIMARY KEY, applied_utc TEXT, description TEXT)
    runs(run_id TEXT PRIMARY KEY, label TEXT, method TEXT, config_hash TEXT, repetition INTEGER,
         valid INTEGER, problems TEXT /* JSON list */, started_utc TEXT, finished_utc TEXT,
         concurrency INTEGER, requests INTEGER, errors INTEGER, output_tokens INTEGER,
         decode_tok_s_median REAL, decode_tok_s_p5 REAL, decode_tok_s_p95 REAL,
         decode_tok_s_mean REAL, ttft_s_median REAL, tpot_ms_median REAL,
         tokens_per_chunk_median REAL, acceptance_rate REAL, mean_acceptance_length REAL,
         effective_tokens_per_step REAL, doc TEXT /* the full run JSON */)
    requests(run_id TEXT REFERENCES runs(run_id), idx INTEGER, prompt_id TEXT, category TEXT,
             repeat INTEGER, ok INTEGER, error TEXT, output_tokens INTEGER, chunks INTEGER,
             ttft_s REAL, decode_s REAL, e2e_s REAL, decode_tok_s REAL, tpot_ms REAL,
             tokens_per_chunk REAL, PRIMARY KEY (run_id, idx))

Known ``--meta-json`` keys (all optional, passed by the bench role): ``method``, ``config_hash``,
``repetition``, ``serve_argv``, ``speculative_config``, ``num_speculative_tokens``, ``topology``,
``toolkit_commit``, ``model_revision``, ``drafter_revision``; anything else is kept verbatim.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import math
import os
import queue
import re
import secrets
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparkllm.cli import HelpFormatter
from sparkllm.fileio import sha256_file, write_bytes_atomic

SCRIPTS_DIR = Path(__file__).resolve().parent
DEFAULT_PROMPTS = SCRIPTS_DIR / "prompts" / "prompts.jsonl"
SPECBENCH_MANIFEST = SCRIPTS_DIR / "prompts" / "specbench.json"
STORE_NAME = "results.sqlite"
REPORT_DIRNAME = "report"  # the report's directory inside the store: DIR/report/report.md
REPORT_TOOL = "bench.py report"
CHART_FILES = ("decode_tok_s.png", "acceptance_by_position.png", "speedup_by_category.png")
NO_MATPLOTLIB = ("Charts need matplotlib, which this Python lacks: run `bench.py report` with the toolkit's "
                 "venv (`make setup`, then `.venv/bin/python scripts/bench.py report DIR`).")
SCHEMA_VERSION = 1
TOKEN_MISMATCH_TOLERANCE = 0.01
UNPINNED = "TO-BE-FILLED"


class UsageError(Exception):
    """The command line is wrong (exit 2); the message names the problem and the fix."""


class WorkFailed(Exception):
    """The work was attempted and failed (exit 1); the message says why."""



# --------------------------------------------------------------------------------------------
# prompts


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: list[dict[str, str]]


def load_prompts(path: Path, category: str | None = None) -> tuple[list[Prompt], str]:
    """Read a JSONL prompt set; return (prompts, sha256 of the file bytes)."""
    if not path.is_file():
        raise UsageError(f"prompt file {path} not found: pass --prompts FILE (JSONL with id, category, "
                         "messages) or run fetch-prompts first")
    raw = path.read_bytes()
    prompts: list[Prompt] = []
    for no, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            p = Prompt(str(obj["id"]), str(obj["category"]), list(obj["messages"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{no}: bad prompt line ({exc}); expected JSON with id, category, "
                             "messages") from exc
        if not p.messages or p.messages[-1].get("role") != "user":
            raise SystemExit(f"{path}:{no}: prompt {p.id} must end with a user message")
        prompts.append(p)
    if category:
        wanted = set(category.split(","))
        prompts = [p for p in prompts if p.category in wanted]
    if not prompts:
        raise SystemExit(f"no prompts selected from {path} (category filter: {category!r})")
    return prompts, hashlib.sha256(raw).hexdigest()


# --------------------------------------------------------------------------------------------
# Prometheus text parsing

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


def _delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str, **match: str) -> float | None:
    a, b = before.total(name, **match), after.total(name, **match)
    return None if a is None or b is None else b - a


# --------------------------------------------------------------------------------------------
# statistics

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Two-sided 95 % Student t critical value (table to 30, Cornish-Fisher expansion beyond)."""
    if df < 1:
        return math.nan
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: Iterable[float | None]) -> dict[str, Any]:
    """median/p5/p95/p99/mean/min/max/n, mean 95 % t-interval and CV; nulls when empty."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {k: None for k in ("n", "median", "p5", "p95", "p99", "mean", "min", "max", "stdev",
                                  "ci95_low", "ci95_high", "cv")} | {"n": 0}
    mean = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else None
    half = t975(len(xs) - 1) * sd / math.sqrt(len(xs)) if sd is not None else None
    return {
        "n": len(xs), "median": statistics.median(xs), "p5": percentile(xs, 5), "p95": percentile(xs, 95),
        "p99": percentile(xs, 99), "mean": mean, "min": min(xs), "max": max(xs), "stdev": sd,
        "ci95_low": mean - half if half is not None else None,
        "ci95_high": mean + half if half is not None else None,
        "cv": sd / mean if sd is not None and mean else None,
    }


def fit_iid_acceptance(tau: float, k: int, tol: float = 1e-12) -> float:
    """Solve (1 - a^(K+1)) / (1 - a) = tau for a in [0, 1] by bisection (sum_{j<=K} a^j = tau)."""
    if k < 1 or tau <= 1.0:
        return 0.0
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(k + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --------------------------------------------------------------------------------------------
# HTTP client


@dataclass
class Endpoint:
    base_url: str
    api_key: str | None = None
    timeout: float = 600.0

    def _conn(self) -> http.client.HTTPConnection:
        u = urllib.parse.urlsplit(self.base_url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        return cls(u.hostname or "127.0.0.1", u.port, timeout=self.timeout)

    def path(self, p: str) -> str:
        prefix = urllib.parse.urlsplit(self.base_url).path.rstrip("/")
        if prefix.endswith("/v1") and p.startswith("/v1/"):
            prefix = prefix[:-3]
        return prefix + p

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def get(self, p: str, timeout: float = 10.0) -> tuple[int, bytes]:
        conn = self._conn()
        conn.timeout = timeout
        try:
            conn.request("GET", self.path(p), headers=self.headers())
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def metrics(self) -> MetricsSnapshot:
        t = time.monotonic()
        try:
            status, body = self.get("/metrics")
        except OSError:
            return MetricsSnapshot({}, t, ok=False)
        if status != 200:
            return MetricsSnapshot({}, t, ok=False)
        return MetricsSnapshot.parse(body.decode("utf-8", "replace"), t)

    def get_json(self, p: str) -> Any:
        try:
            status, body = self.get(p)
            return json.loads(body) if status == 200 else None
        except (OSError, ValueError):
            return None


@dataclass
class RequestResult:
    idx: int
    prompt_id: str
    category: str
    repeat: int
    ok: bool = False
    error: str | None = None
    t0: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of chunks that carried tokens
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    continuous_usage: bool = False
    raw_chunks: int = 0

    # ---- derived per-request metrics (see module docstring)
    @property
    def m(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.t0 if self.ok and self.token_times else None

    @property
    def decode_s(self) -> float | None:
        return self.token_times[-1] - self.token_times[0] if self.ok and self.m > 1 else None

    @property
    def e2e_s(self) -> float | None:
        return self.token_times[-1] - self.t0 if self.ok and self.token_times else None

    @property
    def decode_tok_s(self) -> float | None:
        n, d = self.output_tokens, self.decode_s
        return (n - 1) / d if n and n > 1 and d else None

    @property
    def tpot_ms(self) -> float | None:
        n, d = self.output_tokens, self.decode_s
        return 1000.0 * d / (n - 1) if n and n > 1 and d else None

    @property
    def tokens_per_chunk(self) -> float | None:
        n = self.output_tokens
        return (n - 1) / (self.m - 1) if n and n > 1 and self.m > 1 else None

    @property
    def icl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    def row(self) -> dict[str, Any]:
        return {"idx": self.idx, "prompt_id": self.prompt_id, "category": self.category,
                "repeat": self.repeat, "ok": self.ok, "error": self.error,
                "output_tokens": self.output_tokens, "chunks": self.m, "ttft_s": self.ttft_s,
                "decode_s": self.decode_s, "e2e_s": self.e2e_s, "decode_tok_s": self.decode_tok_s,
                "tpot_ms": self.tpot_ms, "tokens_per_chunk": self.tokens_per_chunk,
                "continuous_usage": self.continuous_usage}


@dataclass
class Sampling:
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = 0
    thinking: str = "off"


def build_payload(model: str, prompt: Prompt, s: Sampling, continuous: bool) -> dict[str, Any]:
    opts: dict[str, Any] = {"include_usage": True}
    if continuous:
        opts["continuous_usage_stats"] = True
    body: dict[str, Any] = {"model": model, "messages": prompt.messages, "stream": True,
                            "max_tokens": s.max_tokens, "temperature": s.temperature,
                            "stream_options": opts,
                            "chat_template_kwargs": {"enable_thinking": s.thinking == "on"}}
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def _chunk_has_content(obj: dict[str, Any]) -> bool:
    for ch in obj.get("choices") or []:
        delta = ch.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                return True
        if delta.get("tool_calls"):
            return True
    return False


class UnsupportedOption(Exception):
    """The server rejected continuous_usage_stats."""


def stream_request(ep: Endpoint, payload: dict[str, Any], res: RequestResult) -> None:
    """Send one streaming request, filling res.token_times/output_tokens; never raises for HTTP errors."""
    conn = ep._conn()
    try:
        body = json.dumps(payload).encode()
        res.t0 = time.monotonic()
        conn.request("POST", ep.path("/v1/chat/completions"), body=body, headers=ep.headers())
        r = conn.getresponse()
        if r.status != 200:
            text = r.read()[:300].decode("utf-8", "replace")
            if r.status == 400 and "continuous_usage_stats" in text:
                raise UnsupportedOption(text)
            res.error = f"HTTP {r.status}: {text}"
            return
        _consume_sse(r, res)
    except UnsupportedOption:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def _consume_sse(r: http.client.HTTPResponse, res: RequestResult) -> None:
    last_count = 0
    final_usage: int | None = None
    content_times: list[float] = []
    usage_times: list[float] = []
    done = False
    while True:
        line = r.readline()
        if not line:
            break
        t = time.monotonic()
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj and not obj.get("choices"):
            res.error = f"server error in stream: {str(obj['error'])[:200]}"
            return
        res.raw_chunks += 1
        usage = obj.get("usage") or None
        has_choices = bool(obj.get("choices"))
        if usage is not None and usage.get("completion_tokens") is not None:
            count = int(usage["completion_tokens"])
            if has_choices:
                res.continuous_usage = True
                if count > last_count:
                    usage_times.append(t)
                    last_count = count
            final_usage = count
            if usage.get("prompt_tokens") is not None:
                res.prompt_tokens = int(usage["prompt_tokens"])
        if has_choices and _chunk_has_content(obj):
            content_times.append(t)
    if not done:
        res.error = "stream ended without [DONE]"
        return
    res.token_times = usage_times if res.continuous_usage else content_times
    if final_usage is None:
        res.error = "no usage in stream (server ignored stream_options.include_usage)"
        return
    res.output_tokens = final_usage
    res.ok = True


# --------------------------------------------------------------------------------------------
# the run


@dataclass
class RunOptions:
    base_url: str
    model: str
    label: str
    out: Path
    prompts: Path = DEFAULT_PROMPTS
    category: str | None = None
    repeats: int = 1
    warmup: int = 2
    concurrency: int = 1
    sampling: Sampling = field(default_factory=Sampling)
    api_key: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    sample_interval: float = 0.2
    progress: bool = True


class Progress:
    """Progress on stderr: rich when importable, otherwise a plain carriage-return line."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.done, self.enabled = total, label, 0, enabled
        self.lock = threading.Lock()
        self._rich: Any = None
        self._task: Any = None
        self.tty = sys.stderr.isatty()
        if enabled and self.tty:
            try:
                from rich.progress import Progress as RichProgress  # optional on the Spark

                self._rich = RichProgress(transient=True)
                self._rich.start()
                self._task = self._rich.add_task(label, total=total)
            except ImportError:
                self._rich = None

    def step(self, info: str = "") -> None:
        with self.lock:
            self.done += 1
            if not self.enabled:
                return
            if self._rich is not None:
                self._rich.update(self._task, advance=1, description=f"{self.label} {info}")
            elif self.tty:
                sys.stderr.write(f"\r[{self.label}] {self.done}/{self.total} {info:<40}")
                sys.stderr.flush()
            elif self.done % max(1, self.total // 10) == 0 or self.done == self.total:
                sys.stderr.write(f"[{self.label}] {self.done}/{self.total} {info}\n")  # logs: ~10 lines
                sys.stderr.flush()

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.enabled and self.tty:
            sys.stderr.write("\n")


class RunningSampler(threading.Thread):
    """Polls /metrics during the measured phase: max running requests and restarts."""

    def __init__(self, ep: Endpoint, interval: float, first: MetricsSnapshot) -> None:
        super().__init__(daemon=True)
        self.ep, self.interval = ep, interval
        self.stop_evt = threading.Event()
        self.max_running: float | None = None
        self.samples = 0
        self.prev = first
        self.problems: list[str] = []

    def run(self) -> None:
        while not self.stop_evt.wait(self.interval):
            snap = self.ep.metrics()
            if not snap.ok:
                continue
            self.samples += 1
            running = snap.total(M_RUNNING)
            if running is not None:
                self.max_running = running if self.max_running is None else max(self.max_running, running)
            if self.prev.ok and not self.problems:
                why = restart_problem(self.prev, snap)
                if why:
                    self.problems.append(why)
            self.prev = snap


def _detect_continuous(ep: Endpoint, model: str, prompt: Prompt, s: Sampling) -> bool:
    """Probe once: does the server accept continuous_usage_stats and send usage on content chunks?"""
    probe = Sampling(max_tokens=4, temperature=s.temperature, seed=s.seed, thinking=s.thinking)
    res = RequestResult(-1, prompt.id, prompt.category, 0)
    try:
        stream_request(ep, build_payload(model, prompt, probe, True), res)
    except UnsupportedOption:
        return False
    return res.ok and res.continuous_usage


def _run_requests(ep: Endpoint, opts: RunOptions, work: list[RequestResult], prompts: dict[str, Prompt],
                  continuous: bool, prog: Progress | None) -> None:
    q: queue.Queue[RequestResult] = queue.Queue()
    for w in work:
        q.put(w)

    def worker() -> None:
        while True:
            try:
                res = q.get_nowait()
            except queue.Empty:
                return
            payload = build_payload(opts.model, prompts[res.prompt_id], opts.sampling, continuous)
            try:
                stream_request(ep, payload, res)
            except UnsupportedOption as exc:
                res.error = f"server rejected stream options: {exc}"
            if prog:
                tps = res.decode_tok_s
                prog.step(f"{res.category} {tps:.1f} tok/s" if tps else (res.error or "")[:40])

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, opts.concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _settled_snapshot(ep: Endpoint, expect_tokens: int, before: MetricsSnapshot) -> MetricsSnapshot:
    """Final scrape; retry briefly while the server's token counter lags the client's count."""
    snap = ep.metrics()
    for _ in range(10):
        d = _delta(before, snap, M_GEN) if snap.ok else None
        if d is None or d >= expect_tokens:
            break
        time.sleep(0.1)
        snap = ep.metrics()
    return snap


def _quiet_snapshot(ep: Endpoint, tries: int = 20, interval: float = 0.05) -> MetricsSnapshot:
    """A scrape taken once the server's token counter has stopped moving (two equal readings), so
    tokens of requests that already answered (warm-up, probe) are not counted in the next phase."""
    snap = ep.metrics()
    for _ in range(tries):
        if not snap.ok:
            break
        time.sleep(interval)
        nxt = ep.metrics()
        if nxt.ok and nxt.total(M_GEN) == snap.total(M_GEN):
            return nxt
        snap = nxt
    return snap


def _blocks(prompts: list[Prompt], repeats: int, concurrency: int) -> list[list[tuple[Prompt, int]]]:
    """Measured work. At concurrency 1 one block per category (so /metrics can be diffed per
    category); otherwise one block with every request."""
    cats: dict[str, list[Prompt]] = {}
    for p in prompts:
        cats.setdefault(p.category, []).append(p)
    if concurrency == 1:
        return [[(p, r) for r in range(repeats) for p in ps] for ps in cats.values()]
    return [[(p, r) for r in range(repeats) for p in prompts]]


def spec_metrics(before: MetricsSnapshot, after: MetricsSnapshot,
                 k_hint: int | None = None) -> dict[str, Any]:
    """Server-side speculative decoding metrics from two snapshots; None where not computable."""
    out: dict[str, Any] = {k: None for k in (
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length",
        "per_position", "conditional", "effective_tokens_per_step", "num_speculative_tokens",
        "iid_fit_a", "iid_residuals", "iid_max_abs_residual", "generation_tokens", "steps")}
    if not (before.ok and after.ok):
        return out
    gen = _delta(before, after, M_GEN)
    itl, ttft = _delta(before, after, M_ITL_COUNT), _delta(before, after, M_TTFT_COUNT)
    out["generation_tokens"] = gen
    if gen is not None and itl is not None and ttft is not None and itl + ttft > 0:
        out["steps"] = itl + ttft
        out["effective_tokens_per_step"] = gen / (itl + ttft)
    n, d, a = (_delta(before, after, x) for x in (M_DRAFTS, M_DRAFT_TOK, M_ACCEPTED))
    out.update(num_drafts=n, num_draft_tokens=d, num_accepted_tokens=a)
    if not n or a is None:
        return out
    out["acceptance_rate"] = a / d if d else None
    tau = 1.0 + a / n
    out["mean_acceptance_length"] = tau
    b_pos, a_pos = before.by_label(M_ACC_POS, "position"), after.by_label(M_ACC_POS, "position")
    positions = sorted(int(p) for p in a_pos if p.isdigit())
    per_pos = [(a_pos[str(i)] - b_pos.get(str(i), 0.0)) / n for i in positions]
    if positions and positions == list(range(len(positions))):
        out["per_position"] = per_pos
        cond: list[float | None] = []
        prev = 1.0
        for p in per_pos:
            cond.append(p / prev if prev else None)
            prev = p
        out["conditional"] = cond
    k = len(positions) or k_hint
    out["num_speculative_tokens"] = k
    if k:
        alpha = fit_iid_acceptance(tau, k)
        out["iid_fit_a"] = alpha
        if out["per_position"] is not None:
            res = [p - alpha ** (i + 1) for i, p in enumerate(out["per_position"])]
            out["iid_residuals"] = res
            out["iid_max_abs_residual"] = max(abs(r) for r in res)
    return out


def raw_counters(snap: MetricsSnapshot) -> dict[str, Any] | None:
    """The counters the speculative figures are computed from, as the server reported them (so a
    reader can check the figures against an independent scrape); None without /metrics."""
    if not snap.ok:
        return None
    out: dict[str, Any] = {m: snap.total(m) for m in (M_GEN, M_DRAFTS, M_DRAFT_TOK, M_ACCEPTED)}
    out[M_ACC_POS] = snap.by_label(M_ACC_POS, "position")
    return out


def summarise(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    toks = sum((r.output_tokens or 0) for r in ok)
    dec_tok = sum((r.output_tokens or 1) - 1 for r in ok if r.decode_s)
    dec_s = sum(r.decode_s or 0.0 for r in ok if r.decode_s)
    chunks = sum(r.m - 1 for r in ok if r.decode_s)
    icl = [x for r in ok for x in r.icl_s]
    return {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "output_tokens": toks, "wall_s": wall_s,
        "decode_tok_s": describe(r.decode_tok_s for r in ok),
        "ttft_s": describe(r.ttft_s for r in ok),
        "tpot_ms": describe(r.tpot_ms for r in ok),
        "e2e_s": describe(r.e2e_s for r in ok),
        "decode_s": describe(r.decode_s for r in ok),
        "tokens_per_chunk": describe(r.tokens_per_chunk for r in ok),
        "icl_ms": describe(1000.0 * x for x in icl),
        "token_weighted": {
            "decode_tok_s": dec_tok / dec_s if dec_s else None,
            "tpot_ms": 1000.0 * dec_s / dec_tok if dec_tok else None,
            "tokens_per_chunk": dec_tok / chunks if chunks else None,
            "output_tok_s_wall": toks / wall_s if wall_s > 0 else None,
        },
    }


def per_category(results: list[RequestResult], spec_by_cat: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cats: dict[str, list[RequestResult]] = {}
    for r in results:
        cats.setdefault(r.category, []).append(r)
    out: dict[str, Any] = {}
    for cat, rs in sorted(cats.items()):
        ok = [r for r in rs if r.ok]
        dec_tok = sum((r.output_tokens or 1) - 1 for r in ok if r.decode_s)
        dec_s = sum(r.decode_s or 0.0 for r in ok if r.decode_s)
        out[cat] = {
            "requests": len(rs), "errors": len(rs) - len(ok),
            "decode_tok_s": describe(r.decode_tok_s for r in ok),
            "ttft_s_median": describe(r.ttft_s for r in ok)["median"],
            "tokens_per_chunk_median": describe(r.tokens_per_chunk for r in ok)["median"],
            "token_weighted_decode_tok_s": dec_tok / dec_s if dec_s else None,
            "spec": spec_by_cat.get(cat),
        }
    return out


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def gpu_info() -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = [dict(zip(("name", "driver_version"), (x.strip() for x in line.split(",")), strict=False))
            for line in out.splitlines() if line.strip()]
    return {"gpus": gpus} if gpus else None


def toolkit_commit() -> str | None:
    if not shutil.which("git"):
        return None
    try:
        out = subprocess.run(["git", "-C", str(SCRIPTS_DIR), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def make_run_id(label: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"
    return f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{safe}-{secrets.token_hex(3)}"


def validity(errors: int, client_tokens: int, spec_all: dict[str, Any], before: MetricsSnapshot,
             after: MetricsSnapshot, sampler: RunningSampler | None, concurrency: int,
             extra: list[str]) -> list[str]:
    problems = list(extra)
    if errors:
        problems.append(f"{errors} request(s) failed")
    if client_tokens == 0:
        problems.append("no tokens received")
    if not (before.ok and after.ok):
        problems.append("server /metrics unavailable: cannot check token counts, restarts or preemptions")
        return problems
    why = restart_problem(before, after)
    if why is None and sampler is not None and sampler.problems:
        why = sampler.problems[0]
    if why:
        problems.append(why)
    gen = spec_all.get("generation_tokens")
    if gen is None:
        problems.append(f"{M_GEN} missing from /metrics")
    elif client_tokens and abs(gen - client_tokens) > TOKEN_MISMATCH_TOLERANCE * client_tokens:
        problems.append(f"token mismatch: client counted {client_tokens}, server generation_tokens_total "
                        f"grew by {gen:g} (> {TOKEN_MISMATCH_TOLERANCE:.0%} apart)")
    pre = _delta(before, after, M_PREEMPT)
    if pre:
        problems.append(f"{pre:g} preemption(s) during the measured phase")
    if sampler is not None and sampler.max_running is not None and sampler.max_running > concurrency:
        problems.append(f"{sampler.max_running:g} requests running on the server at concurrency "
                        f"{concurrency}: something else is using it")
    return problems


def execute_run(opts: RunOptions) -> dict[str, Any]:
    """Run warm-up + measured phase and return the run document (also stored by cmd_run)."""
    ep = Endpoint(opts.base_url, opts.api_key)
    prompts, prompt_sha = load_prompts(opts.prompts, opts.category)
    by_id = {p.id: p for p in prompts}
    if len(by_id) != len(prompts):
        raise SystemExit(f"duplicate prompt ids in {opts.prompts}")
    started = utc_now()
    version = ep.get_json("/version")
    models = ep.get_json("/v1/models")
    continuous = _detect_continuous(ep, opts.model, prompts[0], opts.sampling)
    warm = [RequestResult(-1 - i, prompts[i % len(prompts)].id, prompts[i % len(prompts)].category, -1)
            for i in range(opts.warmup)]
    _run_requests(ep, opts, warm, by_id, continuous, None)
    blocks = _blocks(prompts, opts.repeats, opts.concurrency)
    total = sum(len(b) for b in blocks)
    prog = Progress(total, opts.label, opts.progress)
    snap0 = _quiet_snapshot(ep)
    sampler = RunningSampler(ep, opts.sample_interval, snap0)
    sampler.start()
    results: list[RequestResult] = []
    spec_by_cat: dict[str, dict[str, Any]] = {}
    extra: list[str] = []
    t_start = time.monotonic()
    prev = snap0
    for block in blocks:
        work = [RequestResult(len(results) + i, p.id, p.category, r) for i, (p, r) in enumerate(block)]
        _run_requests(ep, opts, work, by_id, continuous, prog)
        results.extend(work)
        if len(blocks) > 1:
            toks = sum(w.output_tokens or 0 for w in work if w.ok)
            snap = _settled_snapshot(ep, toks, prev)
            if prev.ok and snap.ok and restart_problem(prev, snap) is None:
                spec_by_cat[work[0].category] = spec_metrics(prev, snap, _k_hint(opts.meta))
            prev = snap
    wall = time.monotonic() - t_start
    prog.close()
    sampler.stop_evt.set()
    sampler.join()
    client_tokens = sum(r.output_tokens or 0 for r in results if r.ok)
    snap1 = _settled_snapshot(ep, client_tokens, snap0) if len(blocks) == 1 else prev
    spec_all = spec_metrics(snap0, snap1, _k_hint(opts.meta))
    errors = sum(1 for r in results if not r.ok)
    problems = validity(errors, client_tokens, spec_all, snap0, snap1, sampler, opts.concurrency, extra)
    meta = build_meta(opts, version, models, prompt_sha, len(prompts), continuous, started, sampler)
    run_id = make_run_id(opts.label)
    doc = {
        "schema": 1, "run_id": run_id, "label": opts.label, "valid": not problems, "problems": problems,
        "summary": summarise(results, wall), "spec": spec_all,
        "spec_counters": {"before": raw_counters(snap0), "after": raw_counters(snap1)},
        "categories": per_category(results, spec_by_cat), "meta": meta,
        "requests": [r.row() for r in results],
        "errors_sample": sorted({r.error for r in results if r.error})[:5],
    }
    doc["meta"]["finished_utc"] = utc_now()
    return doc


def _k_hint(meta: dict[str, Any]) -> int | None:
    k = meta.get("num_speculative_tokens")
    if k is None and isinstance(meta.get("speculative_config"), dict):
        k = meta["speculative_config"].get("num_speculative_tokens")
    try:
        return int(k) if k is not None else None
    except (TypeError, ValueError):
        return None


def build_meta(opts: RunOptions, version: Any, models: Any, prompt_sha: str, n_prompts: int, continuous: bool,
               started: str, sampler: RunningSampler) -> dict[str, Any]:
    meta = dict(opts.meta)
    meta.setdefault("method", opts.label.split("-")[0])
    meta.setdefault("toolkit_commit", toolkit_commit())
    meta.update({
        "model": opts.model, "base_url": opts.base_url, "server_version": version,
        "server_models": ([m.get("id") for m in models.get("data", [])]
                          if isinstance(models, dict) else None),
        "sampling": asdict(opts.sampling),
        "prompts": {"file": str(opts.prompts), "sha256": prompt_sha, "count": n_prompts,
                    "category_filter": opts.category},
        "repeats": opts.repeats, "warmup": opts.warmup, "concurrency": opts.concurrency,
        "continuous_usage_stats": continuous, "gpu": gpu_info(), "python": sys.version.split()[0],
        "started_utc": started, "max_running_sampled": sampler.max_running,
        "running_samples": sampler.samples,
    })
    for key in ("serve_argv", "speculative_config", "topology", "config_hash", "repetition"):
        meta.setdefault(key, None)
    return meta


# --------------------------------------------------------------------------------------------
# store


MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "initial schema: runs + requests", """
CREATE TABLE IF NOT EXISTS schema (version INTEGER PRIMARY KEY, applied_utc TEXT NOT NULL,
                                   description TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, label TEXT NOT NULL, method TEXT, config_hash TEXT, repetition INTEGER,
    valid INTEGER NOT NULL, problems TEXT NOT NULL, started_utc TEXT, finished_utc TEXT,
    concurrency INTEGER, requests INTEGER, errors INTEGER, output_tokens INTEGER,
    decode_tok_s_median REAL, decode_tok_s_p5 REAL, decode_tok_s_p95 REAL, decode_tok_s_mean REAL,
    ttft_s_median REAL, tpot_ms_median REAL, tokens_per_chunk_median REAL, acceptance_rate REAL,
    mean_acceptance_length REAL, effective_tokens_per_step REAL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS runs_cell ON runs (config_hash, repetition);
CREATE TABLE IF NOT EXISTS requests (
    run_id TEXT NOT NULL REFERENCES runs(run_id), idx INTEGER NOT NULL, prompt_id TEXT, category TEXT,
    repeat INTEGER, ok INTEGER, error TEXT, output_tokens INTEGER, chunks INTEGER, ttft_s REAL,
    decode_s REAL, e2e_s REAL, decode_tok_s REAL, tpot_ms REAL, tokens_per_chunk REAL,
    PRIMARY KEY (run_id, idx));
"""),
]


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the store to SCHEMA_VERSION; refuse a newer store than this code understands."""
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > SCHEMA_VERSION:
        raise SystemExit(f"results store schema v{current} is newer than this bench.py (v{SCHEMA_VERSION}): "
                         "update the toolkit")
    for version, desc, sql in MIGRATIONS:
        if version <= current:
            continue
        with conn:
            conn.executescript(sql)
            conn.execute("INSERT OR REPLACE INTO schema VALUES (?, ?, ?)", (version, utc_now(), desc))
            conn.execute(f"PRAGMA user_version = {int(version)}")
        current = version
    return current


def open_store(directory: Path) -> sqlite3.Connection:
    directory.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(directory / STORE_NAME, timeout=30)
    conn.row_factory = sqlite3.Row
    migrate(conn)
    return conn


def store_run(conn: sqlite3.Connection, doc: dict[str, Any]) -> bool:
    """Insert one run document; returns False if that run id is already stored (idempotent)."""
    s, sp, meta = doc.get("summary", {}), doc.get("spec", {}), doc.get("meta", {})
    dec = s.get("decode_tok_s", {})
    rep = meta.get("repetition")
    row = (doc["run_id"], doc["label"], meta.get("method"), meta.get("config_hash"),
           int(rep) if rep is not None else None, int(bool(doc["valid"])), json.dumps(doc["problems"]),
           meta.get("started_utc"), meta.get("finished_utc"), meta.get("concurrency"), s.get("requests"),
           s.get("errors"), s.get("output_tokens"), dec.get("median"), dec.get("p5"), dec.get("p95"),
           dec.get("mean"), s.get("ttft_s", {}).get("median"), s.get("tpot_ms", {}).get("median"),
           s.get("tokens_per_chunk", {}).get("median"), sp.get("acceptance_rate"),
           sp.get("mean_acceptance_length"), sp.get("effective_tokens_per_step"), json.dumps(doc))
    with conn:
        cur = conn.execute(f"INSERT OR IGNORE INTO runs VALUES ({','.join('?' * len(row))})", row)
        if cur.rowcount == 0:
            return False
        conn.executemany(
            "INSERT OR IGNORE INTO requests VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [(doc["run_id"], r["idx"], r["prompt_id"], r["category"], r["repeat"], int(bool(r["ok"])),
              r["error"], r["output_tokens"], r["chunks"], r["ttft_s"], r["decode_s"], r["e2e_s"],
              r["decode_tok_s"], r["tpot_ms"], r["tokens_per_chunk"]) for r in doc.get("requests", [])])
    return True


def atomic_write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, json.dumps(obj, indent=1, sort_keys=False).encode("utf-8"))


def is_run_doc(obj: Any) -> bool:
    return isinstance(obj, dict) and {"run_id", "label", "valid", "problems", "summary"} <= obj.keys()


def import_runs(paths: Sequence[Path], store_dir: Path) -> tuple[int, int]:
    """Copy run JSON files into store_dir and insert them into its SQLite; (added, skipped)."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(p.glob("*.json")))
        elif p.is_file():
            files.append(p)
        else:
            raise UsageError(f"{p} does not exist; pass run JSON files or directories holding them")
    conn = open_store(store_dir)
    added = skipped = 0
    try:
        for f in files:
            try:
                doc = json.loads(f.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise SystemExit(f"import: {f} is not valid JSON ({exc})") from exc
            if not is_run_doc(doc):
                continue
            target = store_dir / f"{doc['run_id']}.json"
            if not target.exists():
                atomic_write_json(target, doc)
            if store_run(conn, doc):
                added += 1
            else:
                skipped += 1
    finally:
        conn.close()
    return added, skipped


# --------------------------------------------------------------------------------------------
# CLI: run


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def print_summary(doc: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    s, sp = doc["summary"], doc["spec"]
    d = s["decode_tok_s"]
    rows = [
        ("run", doc["run_id"]), ("valid", "yes" if doc["valid"] else "NO: " + "; ".join(doc["problems"])),
        ("requests ok/total", f"{s['ok']}/{s['requests']}"),
        ("decode tok/s median [p5-p95]", f"{_fmt(d['median'])} [{_fmt(d['p5'])}-{_fmt(d['p95'])}]"),
        ("decode tok/s mean (95% CI)", f"{_fmt(d['mean'])} ({_fmt(d['ci95_low'])}-{_fmt(d['ci95_high'])})"),
        ("decode tok/s token-weighted", _fmt(s["token_weighted"]["decode_tok_s"])),
        ("TTFT median s", _fmt(s["ttft_s"]["median"], 3)), ("TPOT median ms", _fmt(s["tpot_ms"]["median"])),
        ("tokens/chunk median", _fmt(s["tokens_per_chunk"]["median"])),
        ("acceptance rate", _fmt(sp["acceptance_rate"], 3)),
        ("mean acceptance length", _fmt(sp["mean_acceptance_length"], 3)),
        ("per-position acceptance", "/".join(_fmt(x, 3) for x in sp["per_position"] or []) or "-"),
        ("effective tokens/step", _fmt(sp["effective_tokens_per_step"], 3)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=out)


def _read_meta(arg: str | None) -> dict[str, Any]:
    if not arg:
        return {}
    text = arg
    if not arg.lstrip().startswith("{"):
        p = Path(arg)
        if not p.is_file():
            raise UsageError(f"--meta-json: {arg} is neither a JSON object nor a file")
        text = p.read_text(encoding="utf-8")
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--meta-json: invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise UsageError("--meta-json must be a JSON object")
    return obj


def check_base_url(url: str) -> str:
    """The URL without a trailing slash; UsageError unless it is http(s)://HOST[:PORT][/PATH]."""
    fix = "pass --base-url like http://127.0.0.1:8000"
    u = urllib.parse.urlsplit(url.strip())
    if u.scheme not in ("http", "https"):
        raise UsageError(f"--base-url {url!r}: scheme must be http or https; {fix}")
    if not u.hostname:
        raise UsageError(f"--base-url {url!r}: no host; {fix}")
    try:
        port = u.port
    except ValueError:
        raise UsageError(f"--base-url {url!r}: the port is not a number in 1..65535; {fix}") from None
    if port == 0:
        raise UsageError(f"--base-url {url!r}: port 0 is not a server port; {fix}")
    if u.query or u.fragment or u.username or u.password:
        raise UsageError(f"--base-url {url!r}: no query, fragment or credentials (use --api-key-file); {fix}")
    return url.strip().rstrip("/")


def check_reachable(ep: Endpoint, timeout: float = 10.0) -> None:
    """WorkFailed unless a server answers GET /v1/models at the base URL."""
    try:
        status, _ = ep.get("/v1/models", timeout=timeout)
    except (OSError, http.client.HTTPException) as exc:
        raise WorkFailed(f"nothing answers at {ep.base_url} ({exc}); start the server (make deploy, "
                         "ansible-playbook site.yml --tags serve) or fix --base-url") from None
    if status in (401, 403):
        raise WorkFailed(f"{ep.base_url} refused the request (HTTP {status}): pass --api-key-file with "
                         "the server's API key")
    if status >= 400:
        raise WorkFailed(f"{ep.base_url}/v1/models answered HTTP {status}: is this an OpenAI-compatible "
                         "server (vLLM)? fix --base-url")


def read_api_key(path: str | None) -> str | None:
    if not path:
        return None
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UsageError(f"--api-key-file {path}: cannot read it ({exc.strerror}); pass a readable file "
                         "holding the API key") from None
    if not key:
        raise UsageError(f"--api-key-file {path}: the file is empty; put the API key in it")
    return key


def cmd_run(a: argparse.Namespace) -> int:
    if a.concurrency < 1 or a.repeats < 1 or a.warmup < 0 or a.max_tokens < 2:
        raise UsageError("need --concurrency >= 1, --repeats >= 1, --warmup >= 0, --max-tokens >= 2")
    base_url = check_base_url(a.base_url)
    api_key = read_api_key(a.api_key_file)
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory; pass a results directory")
    load_prompts(Path(a.prompts), a.category)  # bad or missing prompts: a usage error, before any request
    meta = _read_meta(a.meta_json)
    check_reachable(Endpoint(base_url, api_key))
    opts = RunOptions(base_url=base_url, model=a.model, label=a.label, out=out,
                      prompts=Path(a.prompts), category=a.category, repeats=a.repeats, warmup=a.warmup,
                      concurrency=a.concurrency, api_key=api_key, meta=meta,
                      sampling=Sampling(a.max_tokens, a.temperature, a.seed, a.thinking),
                      progress=not a.quiet)
    doc = execute_run(opts)
    path = opts.out / f"{doc['run_id']}.json"
    atomic_write_json(path, doc)
    conn = open_store(opts.out)
    try:
        store_run(conn, doc)
    finally:
        conn.close()
    print_summary(doc)
    print(f"wrote {path}")
    if not doc["valid"]:
        print(f"bench.py run: error: run {doc['run_id']} is invalid: {'; '.join(doc['problems'])} "
              "(written and stored, marked invalid)", file=sys.stderr)
        return 1
    return 0


def find_run(store_dir: Path, config_hash: str, repetition: int) -> str | None:
    """Run id of a valid stored run measured with this configuration hash and repetition, if any."""
    db = store_dir / STORE_NAME
    if not db.is_file():
        return None
    conn = open_store(store_dir)
    try:
        row = conn.execute("SELECT run_id FROM runs WHERE valid = 1 AND config_hash = ? AND repetition = ? "
                           "ORDER BY started_utc LIMIT 1", (config_hash, repetition)).fetchone()
    finally:
        conn.close()
    return row["run_id"] if row else None


def cmd_lookup(a: argparse.Namespace) -> int:
    run_id = find_run(Path(a.store), a.config_hash, a.repetition)
    if run_id is None:
        return 1
    print(run_id)
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    paths = [Path(p) for p in a.paths]
    store = Path(a.store) if a.store else (paths[0] if paths[0].is_dir() else paths[0].parent)
    added, skipped = import_runs(paths, store)
    print(f"imported {added} run(s), {skipped} already present, store {store / STORE_NAME}")
    return 0


# --------------------------------------------------------------------------------------------
# fetch-prompts


def convert_specbench(src: Path, dest: Path) -> int:
    """Spec-Bench question.jsonl ({question_id, category, turns[]}) -> our JSONL (first turn only)."""
    lines = []
    for no, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turn = q["turns"][0]
            lines.append(json.dumps({"id": f"specbench-{q['question_id']}", "category": str(q["category"]),
                                     "messages": [{"role": "user", "content": turn}]}))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise SystemExit(f"{src}:{no}: not a Spec-Bench question line ({exc})") from exc
    write_bytes_atomic(dest, ("\n".join(lines) + "\n").encode("utf-8"))
    return len(lines)


def fetch_prompts(manifest: dict[str, Any], dest: Path, url: str | None = None, sha256: str | None = None,
                  allow_unpinned: bool = False) -> int:
    """Download, verify the sha256, convert. Refuses an unpinned or mismatching file."""
    commit = manifest.get("commit", UNPINNED)
    want = (sha256 or manifest.get("sha256") or UNPINNED).lower()
    pinned = UNPINNED.lower() not in want and UNPINNED not in commit
    if url is None:
        url = manifest["url_template"].format(commit=commit if UNPINNED not in commit else "main")
    if not pinned and not allow_unpinned:
        raise SystemExit(f"{manifest.get('name', 'prompt source')} is not pinned (commit/sha256 to be filled "
                         "in scripts/prompts/specbench.json): fill them, pass --sha256, or --allow-unpinned")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmpname = tempfile.mkstemp(prefix=".download.", dir=dest.parent)
    tmp = Path(tmpname)
    try:
        with os.fdopen(fd, "wb") as fh, urllib.request.urlopen(url, timeout=120) as r:  # noqa: S310
            shutil.copyfileobj(r, fh)
        got = sha256_file(tmp)
        if pinned and got != want:
            raise SystemExit(f"sha256 mismatch for {url}: expected {want}, got {got}; refusing to use it "
                             "(wrong commit or tampered download)")
        if not pinned:
            print(f"WARNING: unpinned download, sha256 {got}: pin it in specbench.json", file=sys.stderr)
        lines = manifest.get("lines")
        if pinned and sha256 is None and isinstance(lines, int):
            n = sum(1 for line in tmp.read_text(encoding="utf-8").splitlines() if line.strip())
            if n != lines:
                raise SystemExit(f"{url}: {n} questions, the pinned file has {lines}; refusing to use it")
        return convert_specbench(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def cmd_fetch_prompts(a: argparse.Namespace) -> int:
    if a.source != "specbench":
        raise UsageError(f"unknown prompt source {a.source!r}: only 'specbench'")
    if Path(a.dest).is_dir():
        raise UsageError(f"--dest {a.dest}: is a directory; name the JSONL file to write")
    try:
        manifest = json.loads(Path(a.manifest).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--manifest {a.manifest}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise UsageError(f"--manifest {a.manifest}: invalid JSON ({exc})") from None
    n = fetch_prompts(manifest, Path(a.dest), a.url, a.sha256, a.allow_unpinned)
    print(f"wrote {n} prompts to {a.dest}")
    return 0


# --------------------------------------------------------------------------------------------
# report (controller)


@dataclass
class RunRow:
    run_id: str
    label: str
    valid: bool
    problems: list[str]
    repetition: int | None
    started: str | None
    median: float | None
    doc: dict[str, Any]
    decode: list[float]
    by_cat: dict[str, list[float]]

    @property
    def config_hash(self) -> str | None:
        h = self.doc.get("meta", {}).get("config_hash")
        return str(h) if h else None

    @property
    def context(self) -> str:
        """What a comparison must hold equal: load, token budget, sampling, model, prompts, topology."""
        m = self.doc.get("meta", {})
        s = m.get("sampling") or {}
        p = m.get("prompts") or {}
        ctx = {"concurrency": m.get("concurrency"), "max_tokens": s.get("max_tokens"),
               "temperature": s.get("temperature"), "thinking": s.get("thinking"), "model": m.get("model"),
               "prompts": p.get("sha256"), "categories": p.get("category_filter"),
               "topology": m.get("topology")}
        return json.dumps(ctx, sort_keys=True, default=str)

    @property
    def group_key(self) -> tuple[str, str | None, str, str | None]:
        """Runs pooled as one row: same label, configuration hash, context and server image."""
        image = self.doc.get("meta", {}).get("image")
        return self.label, self.config_hash, self.context, str(image) if image else None


def load_runs(store_dir: Path) -> list[RunRow]:
    if not (store_dir / STORE_NAME).exists():
        if any(store_dir.glob("*.json")):
            import_runs([store_dir], store_dir)
        else:
            raise SystemExit(f"no results store in {store_dir}: run `bench.py run --out {store_dir}` first")
    conn = open_store(store_dir)
    try:
        rows = conn.execute("SELECT run_id, label, valid, problems, repetition, started_utc, "
                            "decode_tok_s_median, doc FROM runs ORDER BY started_utc, run_id").fetchall()
        reqs = conn.execute("SELECT run_id, category, decode_tok_s FROM requests WHERE ok = 1 "
                            "AND decode_tok_s IS NOT NULL").fetchall()
    finally:
        conn.close()
    dec: dict[str, list[float]] = {}
    cats: dict[str, dict[str, list[float]]] = {}
    for r in reqs:
        dec.setdefault(r["run_id"], []).append(r["decode_tok_s"])
        cats.setdefault(r["run_id"], {}).setdefault(r["category"], []).append(r["decode_tok_s"])
    return [RunRow(r["run_id"], r["label"], bool(r["valid"]), json.loads(r["problems"]), r["repetition"],
                   r["started_utc"], r["decode_tok_s_median"], json.loads(r["doc"]), dec.get(r["run_id"], []),
                   cats.get(r["run_id"], {})) for r in rows]


def _ts(s: str | None) -> float:
    if not s:
        return 0.0
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def pair_runs(method: list[RunRow], base: list[RunRow]) -> list[tuple[RunRow, RunRow]]:
    """Pair each method run with a baseline run: same repetition index when both have one, else
    the baseline run with the closest start timestamp (each baseline run used at most once per
    method while unused ones remain)."""
    pairs: list[tuple[RunRow, RunRow]] = []
    by_rep = {b.repetition: b for b in base if b.repetition is not None}
    unused = list(base)
    for m in method:
        b = by_rep.get(m.repetition) if m.repetition is not None else None
        if b is None:
            pool = unused or base
            if not pool:
                continue
            b = min(pool, key=lambda x: abs(_ts(x.started) - _ts(m.started)))
        if b in unused:
            unused.remove(b)
        pairs.append((m, b))
    return pairs


def geo_speedup(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """Geometric mean of paired ratios with a 95 % t-interval on the log scale."""
    logs = [math.log(m / b) for m, b in pairs if m and b and m > 0 and b > 0]
    if not logs:
        return {"gmean": None, "ci95_low": None, "ci95_high": None, "pairs": 0}
    mu = statistics.fmean(logs)
    if len(logs) < 2:
        return {"gmean": math.exp(mu), "ci95_low": None, "ci95_high": None, "pairs": 1}
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"gmean": math.exp(mu), "ci95_low": math.exp(mu - half), "ci95_high": math.exp(mu + half),
            "pairs": len(logs)}


@dataclass
class MethodStats:
    label: str  # the row's name: the run label, with the configuration hash when the label is ambiguous
    runs: list[RunRow]
    decode: dict[str, Any]
    run_medians: dict[str, Any]
    speedup: dict[str, Any]
    ttft_median: float | None
    acc_len: float | None
    per_position: list[float] | None
    by_cat: dict[str, float | None]
    base_label: str = ""  # the run label itself
    config_hash: str | None = None
    context: str = ""
    baseline_row: str | None = None  # name of the row this one was paired with


def _mean_opt(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.fmean(v) if v else None


def _mean_positions(lists: list[list[float] | None]) -> list[float] | None:
    good = [x for x in lists if x]
    if not good:
        return None
    n = max(len(x) for x in good)
    return [statistics.fmean([x[i] for x in good if len(x) > i]) for i in range(n)]


def _row_names(keys: list[tuple[str, str | None, str, str | None]]) -> dict[tuple, str]:
    """The label alone when it names one group; else the label with what tells its groups apart."""
    by_label: dict[str, list[tuple]] = {}
    for k in keys:
        by_label.setdefault(k[0], []).append(k)
    names: dict[tuple, str] = {}
    for label, ks in by_label.items():
        if len(ks) == 1:
            names[ks[0]] = label
            continue
        for n, k in enumerate(ks, 1):
            names[k] = f"{label} [{k[1][:12]}]" if k[1] and sum(x[1] == k[1] for x in ks) == 1 else (
                f"{label} [config {n}]")
    return names


def method_table(runs: list[RunRow], baseline: str) -> list[MethodStats]:
    """One row per (label, configuration hash, context, image): runs measured under a different load,
    token budget, model or image are never pooled, and a row is compared only with a baseline row
    measured in the same context."""
    valid = [r for r in runs if r.valid]
    groups: dict[tuple, list[RunRow]] = {}
    for r in valid:
        groups.setdefault(r.group_key, []).append(r)
    names = _row_names(list(groups))
    base_groups = {k: rs for k, rs in groups.items() if k[0] == baseline}
    out = []
    for key, rs in groups.items():
        same_ctx = [k for k in base_groups if k[2] == key[2]]
        bkey = key if key[0] == baseline else (
            max(same_ctx, key=lambda k: len(base_groups[k])) if same_ctx else None)
        base = base_groups[bkey] if bkey is not None else []
        pairs = [(m.median, b.median) for m, b in pair_runs(rs, base)] if base and bkey != key else []
        cats: dict[str, list[float]] = {}
        for r in rs:
            for c, xs in r.by_cat.items():
                cats.setdefault(c, []).extend(xs)
        out.append(MethodStats(
            label=names[key], runs=rs, decode=describe(x for r in rs for x in r.decode),
            run_medians=describe(r.median for r in rs), speedup=geo_speedup(pairs),
            ttft_median=_mean_opt(r.doc["summary"]["ttft_s"]["median"] for r in rs),
            acc_len=_mean_opt(r.doc["spec"].get("mean_acceptance_length") for r in rs),
            per_position=_mean_positions([r.doc["spec"].get("per_position") for r in rs]),
            by_cat={c: statistics.median(xs) if xs else None for c, xs in cats.items()},
            base_label=key[0], config_hash=key[1], context=key[2],
            baseline_row=names[bkey] if bkey is not None else None))
    out.sort(key=lambda m: (m.base_label != baseline, -(m.decode["median"] or 0)))
    return out


def render_markdown(stats: list[MethodStats], invalid: list[RunRow], baseline: str, charts: list[str],
                    notes: Sequence[str] = ()) -> str:
    lines = ["# Speculative decoding benchmark report", "",
             f"Generated {utc_now()}. Decode tok/s is per request, (n-1)/decode time, pooled over the valid "
             "runs of each method. Speedup = geometric mean of paired run-median ratios vs "
             f"`{baseline}` (pairs by repetition index, else closest start time) with a 95 % t-interval. "
             "\"Peak\" is only the labelled p95/max of per-request decode tok/s.", "",
             "## Method comparison", "",
             "| method | runs | requests | decode tok/s median | p5-p95 | mean (95% CI of run medians) | CV "
             "| peak (p95 / max) | speedup vs baseline [95% CI] | TTFT median s | mean acceptance length "
             "| per-position acceptance |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in stats:
        d, rm, sp = m.decode, m.run_medians, m.speedup
        speed = "1 (reference)" if m.base_label == baseline else (
            "- (no baseline run in the same context)" if m.baseline_row is None else "-"
        ) if sp["gmean"] is None else (
            f"{sp['gmean']:.3f}x"
            + (f" [{sp['ci95_low']:.3f}-{sp['ci95_high']:.3f}]" if sp["ci95_low"] else "")
            + f" (n={sp['pairs']})")
        ci = _fmt(rm["mean"]) + (f" ({_fmt(rm['ci95_low'])}-{_fmt(rm['ci95_high'])})"
                                 if rm["ci95_low"] is not None else " (1 run: no interval)")
        pp = "/".join(f"{x:.2f}" for x in m.per_position) if m.per_position else "-"
        lines.append(f"| {m.label} | {len(m.runs)} | {d['n']} | {_fmt(d['median'])} | {_fmt(d['p5'])}-"
                     f"{_fmt(d['p95'])} | {ci} | {_fmt(rm['cv'], 3)} | {_fmt(d['p95'])} / {_fmt(d['max'])} "
                     f"| {speed} | {_fmt(m.ttft_median, 3)} | {_fmt(m.acc_len)} | {pp} |")
    cats = sorted({c for m in stats for c in m.by_cat})
    rows = {m.label: m for m in stats}
    if cats:
        lines += ["", "## Per category (median decode tok/s; ratio = category median / baseline category "
                  "median)", "", "| category | " + " | ".join(m.label for m in stats) + " |",
                  "|---|" + "---|" * len(stats)]
        for c in cats:
            cells = []
            for m in stats:
                v = m.by_cat.get(c)
                base = rows.get(m.baseline_row) if m.baseline_row else None
                b = base.by_cat.get(c) if base else None
                ratio = f" ({v / b:.2f}x)" if v and b and m is not base else ""
                cells.append(f"{_fmt(v)}{ratio}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if len({m.context for m in stats}) > 1 or len(rows) != len({m.base_label for m in stats}):
        lines += ["", "## Configurations (rows are never pooled across these; speedups compare a row with "
                  "the baseline row of the same context)", "",
                  "| row | configuration hash | compared with | context |", "|---|---|---|---|"]
        lines += [f"| {m.label} | {m.config_hash or '-'} | {m.baseline_row or '-'} | `{m.context}` |"
                  for m in stats]
    lines += ["", "## Invalid runs (excluded from the comparison)", ""]
    if invalid:
        lines += ["| run | label | problems |", "|---|---|---|"]
        lines += [f"| {r.run_id} | {r.label} | {'; '.join(r.problems)} |" for r in invalid]
    else:
        lines.append("None.")
    if charts:
        lines += ["", "## Charts", ""] + [f"![{c}]({c})" for c in charts]
    if notes:
        lines += [""] + list(notes)
    return "\n".join(lines) + "\n"


def render_charts(stats: list[MethodStats], baseline: str, out: Path) -> list[str]:
    import matplotlib  # controller only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    labels = [m.label for m in stats]
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(stats)), 4))
    data = [[x for r in m.runs for x in r.decode] or [0.0] for m in stats]
    ax.boxplot(data, whis=(5, 95), showmeans=True)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.set_ylabel("decode tok/s per request (whiskers p5-p95)")
    ax.set_title("Decode speed distribution per method")
    fig.tight_layout()
    fig.savefig(out / "decode_tok_s.png", dpi=100)
    plt.close(fig)
    names.append("decode_tok_s.png")
    fig, ax = plt.subplots(figsize=(5, 4))
    for m in stats:
        if m.per_position:
            ax.plot(range(1, len(m.per_position) + 1), m.per_position, marker="o", label=m.label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance p_i = A_i / N")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by position")
    if any(m.per_position for m in stats):
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=100)
    plt.close(fig)
    names.append("acceptance_by_position.png")
    rows = {m.label: m for m in stats}
    cats = sorted({c for m in stats for c in m.by_cat})
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(cats) + 2), 4))
    others = [m for m in stats if m.base_label != baseline]
    width = 0.8 / max(1, len(others))
    for j, m in enumerate(others):
        base = rows.get(m.baseline_row) if m.baseline_row else None
        ys = [(m.by_cat.get(c) or 0) / b if base and (b := base.by_cat.get(c)) else 0 for c in cats]
        ax.bar([i + j * width for i in range(len(cats))], ys, width, label=m.label)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel(f"speedup vs {baseline} (category medians)")
    ax.set_title("Speedup per category")
    if others:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup_by_category.png", dpi=100)
    plt.close(fig)
    names.append("speedup_by_category.png")
    return names


def check_report_dir(out: Path, store_dir: Path) -> None:
    """UsageError unless ``out`` may hold the report: new, empty, or an earlier report.

    The report may live inside the store (the default, DIR/report) but never be the store itself or
    hold it. A directory holding only report files is an earlier report (written before reports were
    marked) and counts as ours.
    """
    from sparkllm.outdir import OutputRefused, check_output_dir, marker_tool

    out_r, store_r = Path(os.path.realpath(out)), Path(os.path.realpath(store_dir))
    if out_r == store_r or out_r in store_r.parents:
        raise UsageError(f"--out {out}: {'is' if out_r == store_r else 'holds'} the results store "
                         f"{store_dir}; write the report to its own directory, "
                         f"e.g. {store_dir / REPORT_DIRNAME}")
    if out.is_dir() and marker_tool(out) is None:
        names = {e.name for e in out.iterdir()}
        if names and names <= {"report.md", *CHART_FILES}:
            return  # an earlier, unmarked report of ours
    try:
        check_output_dir(out, REPORT_TOOL, flag="--out")
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None


def _charts_available() -> bool:
    try:
        import matplotlib  # noqa: F401  (controller only)
    except ImportError:
        return False
    return True


def make_report(store_dir: Path, out_dir: Path | None = None, baseline: str = "baseline",
                charts: bool = True) -> tuple[Path, list[MethodStats]]:
    """Write OUT/report.md (+ charts) into a temporary directory and swap it into place."""
    from sparkllm.outdir import write_marker

    out = out_dir or store_dir / REPORT_DIRNAME
    check_report_dir(out, store_dir)
    runs = load_runs(store_dir)
    stats = method_table(runs, baseline)
    invalid = [r for r in runs if not r.valid]
    notes: list[str] = []
    if charts and stats and not _charts_available():
        charts = False
        notes.append(NO_MATPLOTLIB)
        print(NO_MATPLOTLIB, file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_marker(tmp, REPORT_TOOL)
        names = render_charts(stats, baseline, tmp) if charts and stats else []
        md = render_markdown(stats, invalid, baseline, names, notes)
        (tmp / "report.md").write_text(md, encoding="utf-8")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out / "report.md", stats


def cmd_report(a: argparse.Namespace) -> int:
    store = Path(a.dir)
    if not store.is_dir():
        raise UsageError(f"{store}: not a directory; pass the results store directory "
                         f"(it holds {STORE_NAME})")
    path, stats = make_report(store, Path(a.out) if a.out else None, a.baseline, not a.no_charts)
    print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n")[0],
                                epilog=__doc__[__doc__.index("Exit codes:"):].split("\n\n")[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def parser(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)

    r = parser("run", "benchmark a running server (stdlib only)")
    r.add_argument("--base-url", required=True, help="server URL, http(s)://HOST[:PORT], e.g. http://127.0.0.1:8000")
    r.add_argument("--model", required=True, help="served model name")
    r.add_argument("--label", required=True, help="method/config label, e.g. mtp-k2")
    r.add_argument("--out", required=True, help="results directory (run JSON + results.sqlite)")
    r.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL prompt set")
    r.add_argument("--category", default=None, help="only these categories, comma separated (default: all)")
    r.add_argument("--repeats", type=int, default=1, help="passes over the prompt set")
    r.add_argument("--warmup", type=int, default=2, help="warm-up requests, not measured")
    r.add_argument("--max-tokens", type=int, default=256, help="tokens generated per request")
    r.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    r.add_argument("--seed", type=int, default=0, help="sampling seed")
    r.add_argument("--api-key-file", default=None,
                   help="file holding the server's API key (default: none, no Authorization header)")
    r.add_argument("--meta-json", default=None,
                   help="JSON object or file with serve args, spec config, ... (default: none)")
    r.add_argument("--thinking", choices=("on", "off"), default="off", help="the model's thinking mode")
    r.add_argument("--quiet", action="store_true",
                   help="no progress line (the summary, the written path and, for a failed run, the one "
                        "line saying why are still printed)")
    r.set_defaults(func=cmd_run)
    i = parser("import", "merge run JSON files into a store directory (idempotent)")
    i.add_argument("paths", nargs="+", help="run JSON files or directories holding them")
    i.add_argument("--store", default=None, help="store directory (default: the first directory given)")
    i.set_defaults(func=cmd_import)
    lk = parser("lookup", "print the valid run stored for a configuration hash + repetition "
                "(exit 1 when there is none)")
    lk.add_argument("--store", required=True, help="store directory")
    lk.add_argument("--config-hash", required=True, help="configuration hash")
    lk.add_argument("--repetition", type=int, required=True, help="repetition index")
    lk.set_defaults(func=cmd_lookup)
    rep = parser("report", "Markdown report + PNG charts (charts need matplotlib) from a store")
    rep.add_argument("dir", help="results store directory")
    rep.add_argument("--out", default=None, help=f"report directory (default: DIR/{REPORT_DIRNAME})")
    rep.add_argument("--baseline", default="baseline", help="label of the baseline method")
    rep.add_argument("--no-charts", action="store_true", help="Markdown only")
    rep.set_defaults(func=cmd_report)
    f = parser("fetch-prompts", "download + verify + convert an external prompt set")
    f.add_argument("--source", required=True, choices=("specbench",), help="prompt source")
    f.add_argument("--dest", required=True, help="converted JSONL file to write")
    f.add_argument("--manifest", default=str(SPECBENCH_MANIFEST), help="pinned source manifest")
    f.add_argument("--url", default=None,
                   help="override the download URL (mirror, file://; default: the manifest's pinned URL)")
    f.add_argument("--sha256", default=None, help="override the pinned sha256 (default: the manifest's)")
    f.add_argument("--allow-unpinned", action="store_true", help="accept a source without a pinned sha256")
    f.set_defaults(func=cmd_fetch_prompts)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    where = f"bench.py {a.cmd}"
    try:
        return int(a.func(a))
    except UsageError as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
    except WorkFailed as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:
        if isinstance(exc.code, str):  # raised with a message deeper down: a failure of the work
            print(f"{where}: error: {exc.code}", file=sys.stderr)
            return 1
        raise
    except (OSError, sqlite3.Error) as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
