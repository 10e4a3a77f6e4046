"""bench: the run itself (warm-up, measured phase, /metrics snapshots, validity, the run document).
Runs ON THE SPARK: standard library only (rich, when importable, only draws the progress bar on a terminal).

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
"""

from __future__ import annotations

import queue
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparkllm.bench.client import (
    Endpoint,
    RequestResult,
    Sampling,
    UnsupportedOption,
    build_payload,
    send_request,
    stream_request,
)
from sparkllm.bench.common import DEFAULT_PROMPTS, SCRIPTS_DIR, utc_now
from sparkllm.bench.depth import DEFAULT_TOLERANCE, Filler, at_depth, calibrate, salted_payload
from sparkllm.bench.profiles import agent_summary, records_summary, run_agent, with_context
from sparkllm.bench.prometheus import (
    M_ACC_POS,
    M_ACCEPTED,
    M_DRAFT_TOK,
    M_DRAFTS,
    M_GEN,
    M_ITL_COUNT,
    M_PREEMPT,
    M_RUNNING,
    M_TTFT_COUNT,
    MetricsSnapshot,
    delta,
    restart_problem,
)
from sparkllm.bench.prompts import Prompt, load_prompts
from sparkllm.bench.rate import arrivals, goodput, meets, run_open_loop
from sparkllm.bench.records import PROFILES
from sparkllm.bench.stall import DEFAULT_GIVE_UP_S, DEFAULT_STALL_S, StallWatch, outlier_warning, outliers
from sparkllm.bench.stats import describe, fit_iid_acceptance
from sparkllm.bench.telemetry import Telemetry
from sparkllm.cli import Interrupted, signal_exit

TOKEN_MISMATCH_TOLERANCE = 0.01


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
    depth: int = 0  # target input tokens per request (0: the prompt set as it is)
    depth_tolerance: float = DEFAULT_TOLERANCE
    depth_text: Filler | None = None  # the owner's text as depth filler (None: the generated one)
    telemetry_interval: float = 1.0
    nvidia_smi: str | None = None  # path of nvidia-smi (None: looked up on PATH; "": none)
    # request-rate mode (sparkllm.bench.rate): open-loop Poisson arrivals instead of a concurrency level
    request_rate: float | None = None  # requests/s (None: closed loop at ``concurrency``)
    num_requests: int | None = None  # arrivals to send (None with no duration: prompts x repeats)
    duration_s: float | None = None  # or every arrival before this many seconds
    arrival_seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)  # target name -> milliseconds
    # sparkllm.bench.records: decode (streamed decode tok/s), records (the public records' protocol: whole
    # requests, e2e tok/s), agent (multi-turn conversations sharing a growing prefix)
    profile: str = "decode"
    warmup_pass: bool = False  # discard a whole first pass over the prompts instead of `warmup` requests
    agent_context_words: int = 3000  # agent: words of background in each conversation's first turn
    stall_timeout: float = DEFAULT_STALL_S  # sparkllm.bench.stall: no progress this long: the run is invalid
    stall_give_up: float = DEFAULT_GIVE_UP_S  # ... this long: the run ends, written as partial and invalid


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
            if self.ep.watch is not None:  # a whole request's one sign of progress (sparkllm.bench.stall)
                self.ep.watch.counter_reading(snap.total(M_GEN))
            running = snap.total(M_RUNNING)
            if running is not None:
                self.max_running = running if self.max_running is None else max(self.max_running, running)
            if self.prev.ok and not self.problems:
                why = restart_problem(self.prev, snap)
                if why:
                    self.problems.append(why)
            self.prev = snap


def _detect_continuous(ep: Endpoint, model: str, prompt: Prompt, s: Sampling, salted: bool = False) -> bool:
    """Probe once: does the server accept continuous_usage_stats and send usage on content chunks?
    ``salted`` (a depth run): the probe carries its own cache_salt like every other request of the run."""
    probe = Sampling(max_tokens=4, temperature=s.temperature, seed=s.seed, thinking=s.thinking)
    res = RequestResult(-1, prompt.id, prompt.category, 0)
    try:
        stream_request(ep, (salted_payload if salted else build_payload)(model, prompt, probe, True), res)
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
            build = salted_payload if opts.depth else build_payload
            payload = build(opts.model, prompts[res.prompt_id], opts.sampling, continuous)
            try:
                send_request(ep, payload, res)
            except UnsupportedOption as exc:
                res.error = f"server rejected stream options: {exc}"
            if prog:
                tps = res.decode_tok_s or res.e2e_tok_s
                prog.step(f"{res.category} {tps:.1f} tok/s" if tps else (res.error or "")[:40])

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, opts.concurrency))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C, SIGTERM: no worker takes another request
        while not q.empty():
            q.get_nowait()
        raise


def _rate_work(prompts: list[Prompt], opts: RunOptions) -> tuple[list[RequestResult], list[float]]:
    """The arrivals of a rate run (seeded schedule) and their requests: prompt i mod n, repeat i div n."""
    assert opts.request_rate
    if opts.duration_s:
        offsets = arrivals(opts.request_rate, opts.arrival_seed, duration=opts.duration_s)
    else:
        offsets = arrivals(opts.request_rate, opts.arrival_seed,
                           num=opts.num_requests or len(prompts) * opts.repeats)
    work = []
    for i, off in enumerate(offsets):
        p = prompts[i % len(prompts)]
        res = RequestResult(i, p.id, p.category, i // len(prompts))
        res.arrival_s = off
        work.append(res)
    return work, offsets


def _run_rate(ep: Endpoint, opts: RunOptions, work: list[RequestResult], offsets: list[float],
              prompts: dict[str, Prompt], continuous: bool, prog: Progress | None) -> dict[str, Any]:
    build = salted_payload if opts.depth else build_payload

    def send(i: int) -> None:
        res = work[i]
        try:
            send_request(ep, build(opts.model, prompts[res.prompt_id], opts.sampling, continuous), res)
        except UnsupportedOption as exc:
            res.error = f"server rejected stream options: {exc}"
        if prog:
            prog.step(f"{res.category} ttft {res.ttft_s:.2f}s" if res.ttft_s else (res.error or "")[:40])

    out = run_open_loop(offsets, send)
    lags = out.pop("lags_s")
    for res, lag in zip(work, lags, strict=True):
        res.lag_s = lag
    return {"max_in_flight": out["max_in_flight"], "dispatch_lag_s": describe(lags)}


def _settled_snapshot(ep: Endpoint, expect_tokens: int, before: MetricsSnapshot,
                      expect_requests: int = 0) -> MetricsSnapshot:
    """Final scrape; retry briefly while the server's counters lag the client's view: its token
    counter below the tokens the client received, or its TTFT count below the requests that
    answered (vLLM records a step's stats after it has sent the step's output)."""
    snap = ep.metrics()
    for _ in range(10):
        if not snap.ok:
            break
        d = delta(before, snap, M_GEN)
        n = delta(before, snap, M_TTFT_COUNT)
        if (d is None or d >= expect_tokens) and (n is None or n >= expect_requests):
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
    gen = delta(before, after, M_GEN)
    itl, ttft = delta(before, after, M_ITL_COUNT), delta(before, after, M_TTFT_COUNT)
    out["generation_tokens"] = gen
    if gen is not None and itl is not None and ttft is not None and itl + ttft > 0:
        out["steps"] = itl + ttft
        out["effective_tokens_per_step"] = gen / (itl + ttft)
    n, d, a = (delta(before, after, x) for x in (M_DRAFTS, M_DRAFT_TOK, M_ACCEPTED))
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
    pre = delta(before, after, M_PREEMPT)
    if pre:
        problems.append(f"{pre:g} preemption(s) during the measured phase")
    if sampler is not None and sampler.max_running is not None and sampler.max_running > concurrency:
        problems.append(f"{sampler.max_running:g} requests running on the server while this run had at "
                        f"most {concurrency} in flight: something else is using it")
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
    depth_meta = None
    if opts.depth:
        cal = calibrate(ep, opts.model, prompts[0], opts.depth, opts.sampling, opts.depth_tolerance,
                        opts.depth_text)
        prompts = [at_depth(p, cal.words, i, cal.fill) for i, p in enumerate(prompts)]
        by_id = {p.id: p for p in prompts}
        depth_meta = cal.as_dict()
    if opts.profile not in PROFILES:
        raise SystemExit(f"unknown profile {opts.profile!r}: one of {', '.join(PROFILES)}")
    agent = opts.profile == "agent"
    if agent:
        prompts = [with_context(p, opts.agent_context_words, i) for i, p in enumerate(prompts)]
        by_id = {p.id: p for p in prompts}
    salted = bool(opts.depth) or agent  # the probe carries a cache_salt as the run's requests do
    continuous = (_detect_continuous(ep, opts.model, prompts[0], opts.sampling, salted=salted)
                  if opts.sampling.stream else False)
    if agent and opts.warmup_pass:
        warm = run_agent(ep, opts.model, prompts, opts.sampling, continuous, 1)
    else:
        n_warm = len(prompts) if opts.warmup_pass else opts.warmup
        warm = [RequestResult(-1 - i, prompts[i % len(prompts)].id, prompts[i % len(prompts)].category, -1)
                for i in range(n_warm)]
        _run_requests(ep, opts, warm, by_id, continuous, None)
    rate_work, offsets = _rate_work(prompts, opts) if opts.request_rate else ([], [])
    blocks = ([[(by_id[w.prompt_id], w.repeat) for w in rate_work]] if opts.request_rate
              else [[(p, r) for r in range(opts.repeats) for p in prompts]] if agent
              else _blocks(prompts, opts.repeats, opts.concurrency))
    total = (sum(1 + len(p.followups) for p in prompts) * opts.repeats if agent
             else sum(len(b) for b in blocks))
    prog = Progress(total, opts.label, opts.progress)
    snap0 = _quiet_snapshot(ep)
    watch = StallWatch(opts.stall_timeout, opts.stall_give_up)
    watch.saw(warm)  # the warm-up's first-token waits: a long prefill is not a stall
    ep.watch = watch.start()
    sampler = RunningSampler(ep, opts.sample_interval, snap0)
    sampler.start()
    telemetry = Telemetry(opts.telemetry_interval, opts.nvidia_smi)
    telemetry.start()
    results: list[RequestResult] = []
    spec_by_cat: dict[str, dict[str, Any]] = {}
    extra: list[str] = []
    t_start = time.monotonic()
    prev = snap0
    rate_info: dict[str, Any] = {}
    interrupted: str | None = None  # a signal's name: the run is kept, partial (issue 46 item 9)
    work: list[RequestResult] = []
    try:
        for block in blocks:
            work = [RequestResult(len(results) + i, p.id, p.category, r) for i, (p, r) in enumerate(block)]
            if opts.request_rate:
                work = rate_work
                rate_info = _run_rate(ep, opts, work, offsets, by_id, continuous, prog)
            elif agent:
                work = run_agent(ep, opts.model, prompts, opts.sampling, continuous, opts.repeats,
                                 lambda res: prog.step(f"{res.category} ttft {res.ttft_s:.2f}s" if res.ttft_s
                                                       else (res.error or "")[:40]))
            else:
                _run_requests(ep, opts, work, by_id, continuous, prog)
            results.extend(work)
            if len(blocks) > 1:
                toks = sum(w.output_tokens or 0 for w in work if w.ok)
                snap = _settled_snapshot(ep, toks, prev, sum(1 for w in work if w.ok))
                if prev.ok and snap.ok and restart_problem(prev, snap) is None:
                    spec_by_cat[work[0].category] = spec_metrics(prev, snap, _k_hint(opts.meta))
                prev = snap
    except (KeyboardInterrupt, Interrupted) as exc:
        interrupted = signal_exit(exc)[0]
        # requests that ended (answered or failed); the ones in flight are not measured
        kept = {id(r) for r in results}
        results.extend(w for w in work if (w.ok or w.error) and id(w) not in kept)
    wall = time.monotonic() - t_start
    watch.stop()
    ep.watch = None
    if watch.gave_up:  # the requests cut off or never sent are not measured
        results = [r for r in results if id(r) not in watch.unmeasured]
    prog.close()
    sampler.stop_evt.set()
    sampler.join()
    telemetry.stop()
    client_tokens = sum(r.output_tokens or 0 for r in results if r.ok)
    answered = sum(1 for r in results if r.ok)
    snap1 = (MetricsSnapshot({}, time.monotonic(), ok=False) if interrupted or watch.gave_up  # none then
             else _settled_snapshot(ep, client_tokens, snap0, answered) if len(blocks) == 1 else prev)
    spec_all = spec_metrics(snap0, snap1, _k_hint(opts.meta))
    errors = sum(1 for r in results if not r.ok)
    bound = rate_info.get("max_in_flight", 0) if opts.request_rate else opts.concurrency
    problems = validity(errors, client_tokens, spec_all, snap0, snap1, sampler, bound,
                        extra + watch.problems())
    if watch.gave_up:
        problems = [watch.gave_up_line(len(results), total),
                    *([f"{errors} request(s) failed"] if errors else [])]
    if interrupted:
        problems = [f"interrupted by {interrupted} after {len(results)} of {total} requests",
                    *([f"{errors} request(s) failed"] if errors else [])]
    meta = build_meta(opts, version, models, prompt_sha, len(prompts), continuous, started, sampler)
    run_id = make_run_id(opts.label)
    doc = {
        "schema": 4, "run_id": run_id, "label": opts.label, "valid": not problems, "problems": problems,
        "summary": summarise(results, wall), "spec": spec_all,
        "spec_counters": {"before": raw_counters(snap0), "after": raw_counters(snap1)},
        "categories": per_category(results, spec_by_cat), "meta": meta,
        "requests": [r.row() for r in results],
        "errors_sample": sorted({r.error for r in results if r.error})[:5],
    }
    doc["meta"]["finished_utc"] = utc_now()
    if interrupted:
        doc["meta"]["interrupted"] = {"signal": interrupted, "measured": len(results), "planned": total}
    doc["meta"]["input_depth"] = opts.depth or None
    doc["meta"]["depth"] = depth_meta
    if depth_meta:
        got = [r.prompt_tokens for r in results if r.ok and r.prompt_tokens]
        off = [t for t in got if abs(t - opts.depth) > opts.depth_tolerance * opts.depth]
        depth_meta["prompt_tokens"] = describe(got)
        depth_meta["outside_tolerance"] = len(off)
    doc["telemetry"] = telemetry.summary(client_tokens)
    doc["warnings"] = list(doc["telemetry"]["warnings"])
    doc["stall"] = watch.summary()
    doc["stall"]["outliers"] = [] if opts.request_rate else outliers(results)
    doc["warnings"].extend(outlier_warning(o) for o in doc["stall"]["outliers"])
    if depth_meta and depth_meta["outside_tolerance"]:
        doc["warnings"].append(f"{depth_meta['outside_tolerance']} request(s) outside the depth tolerance")
    doc["summary"]["prefill_tok_s"] = describe(r.prefill_tok_s for r in results if r.ok)
    doc["summary"]["prompt_tokens"] = describe(r.prompt_tokens for r in results if r.ok)
    doc["summary"]["goodput"] = goodput(doc["requests"], opts.goodput, wall)
    doc["summary"]["e2e_tok_s"] = describe(r.e2e_tok_s for r in results if r.ok)
    doc["meta"]["profile"] = opts.profile
    if opts.profile == "records":
        doc["records"] = records_summary(results)
    elif agent:
        doc["agent"] = agent_summary(results)
    for row in doc["requests"]:
        row["meets_targets"] = meets(row, opts.goodput) if opts.goodput else None
    doc["meta"]["goodput_targets_ms"] = dict(opts.goodput) or None
    doc["meta"]["request_rate"] = opts.request_rate
    if opts.request_rate:
        doc["meta"]["concurrency"] = None  # open loop: no concurrency level
        span = max(offsets) if len(offsets) > 1 else None
        doc["meta"]["rate"] = {
            "request_rate": opts.request_rate, "arrival_seed": opts.arrival_seed, "arrivals": len(offsets),
            "num_requests": opts.num_requests, "duration_s": opts.duration_s,
            "offered_rate_req_s": (len(offsets) - 1) / span if span else None,
            "completed_rate_req_s": sum(1 for r in results if r.ok) / wall if wall > 0 else None, **rate_info}
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
