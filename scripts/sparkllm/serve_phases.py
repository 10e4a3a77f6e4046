"""The phases of a vLLM server start, read from its log lines (standard library only).

The serve role's readiness wait (``scripts/serve_wait.py``, run by roles/serve/action_plugins/
spark_serve_wait.py) feeds every journal line of the unit to a :class:`Tracker`. A line that matches a
later phase's pattern moves the start into that phase; any line at all counts as progress. A phase's
*budget* is the longest the log may stay silent in it: a start whose log still advances is never
stopped, one that is silent for longer than its phase's budget is reported as stalled in that phase,
with the last lines logged in it.

Every pattern is a logger message of vLLM itself (or of uvicorn / ninja as vLLM runs them), checked in
both releases we serve; ``file:line`` are the 0.19.1 wheel's and the 0.26.0 source's:

==========  ======================================================  ===================================
phase       message                                                 0.19.1 / 0.26.0
==========  ======================================================  ===================================
engine      ``Initializing a V1 LLM engine (v%s) with config: %s``  v1/engine/core.py:106 / :117
weights     ``Starting to load model %s...``                        v1/worker/gpu_model_runner.py:4736
                                                                    / :5251
weights     ``Loading model from scratch...`` (V2 model runner,      v1/worker/gpu/model_runner.py:270
            which DFlash needs)                                     / :284
weights     ``Loading drafter model...``                            v1/worker/gpu_model_runner.py
weights     ``Loading safetensors checkpoint shards`` (tqdm)        model_executor/model_loader/
                                                                    weight_utils.py:864 / :855
weights     ``Loading weights took %.2f seconds``                   model_loader/default_loader.py:385
                                                                    / :431
compile     ``Model loading took %s GiB memory and %.6f seconds``   v1/worker/gpu_model_runner.py:4821
            (ends the load; the profile run, torch.compile and      / :5348 (V2 runner:
            the Triton/PTX JITs follow, often silent for minutes)   v1/worker/gpu/model_runner.py:292
                                                                    / :306, "... GiB and ...")
compile     ``Dynamo bytecode transform time: %.2f s``              compilation/backends.py:1112 / :1156
compile     ``Compiling a graph for compile range %s takes %.2f s`` compilation/backends.py:391 / :394
compile     ``Directly load the compiled graph(s) ...``             compilation/backends.py:286 / :293
compile     ``torch.compile took %.2f s in total``                  compilation/monitor.py:20 / :20
kv_cache    ``Available KV cache memory: %s GiB``                   v1/worker/gpu_worker.py:437 / :561
kv_cache    ``GPU KV cache size: %s tokens``                        v1/core/kv_cache_utils.py:1319
                                                                    / :2177
cuda_graphs ``Capturing CUDA graphs ({}, {})`` (tqdm)               v1/worker/gpu_model_runner.py:6108
                                                                    / :6916
cuda_graphs ``Graph capturing finished in %.0f secs, took %.2f GiB``  v1/worker/gpu_model_runner.py:6047
                                                                    / :6845
api         ``init engine (profile, create kv cache, warmup model)  v1/engine/core.py:284 / :331-348
            took ...``
api         ``Starting vLLM server on %s``                          entrypoints/openai/api_server.py:596
                                                                    / :677
api         ``Available routes are:``                               entrypoints/launcher.py:37 / :37
api         ``Application startup complete.`` (uvicorn 0.54.0)      uvicorn/lifespan/on.py:62
==========  ======================================================  ===================================

``flashinfer``: FlashInfer 0.6.6 compiles its kernels without one log line at INFO (flashinfer/jit/
core.py:309-320, ``build_and_load``; ``run_ninja`` in flashinfer/jit/cpp_ext.py:315-339 captures ninja's
output unless ``FLASHINFER_JIT_VERBOSE=1``). The serve role sets that variable in the server container
(``serve_flashinfer_jit_verbose``), so each compile step prints ninja's ``[n/m] <command>`` line: a
line of that form naming flashinfer enters the ``flashinfer`` phase, with its own budget; the next
line of a main phase leaves it. The fixture logs in tests/fixtures/vllm_start_logs/ are cut from real
vLLM 0.20.0 starts (see their README).
"""

from __future__ import annotations

import re
from collections import deque

# (phase id, what the progress line calls it, default silence budget in seconds), in start order.
PHASES: tuple[tuple[str, str, int], ...] = (
    ("start", "container start and imports", 600),
    ("engine", "engine init", 600),
    ("weights", "weights loading", 1800),
    ("compile", "profile run, torch.compile and kernel JIT", 2400),
    ("kv_cache", "KV cache allocation", 600),
    ("cuda_graphs", "CUDA-graph capture", 1800),
    ("api", "API server start", 300),
)
SIDE_PHASES: tuple[tuple[str, str, int], ...] = (("flashinfer", "FlashInfer JIT compile", 1800),)
TITLES = {p: t for p, t, _ in PHASES + SIDE_PHASES}
DEFAULT_BUDGETS = {p: b for p, _, b in PHASES + SIDE_PHASES}
RANK = {p: i for i, (p, _, _) in enumerate(PHASES)}

PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((phase, re.compile(rx)) for phase, rx in (
    ("engine", r"Initializing a V1 LLM engine \(v"),
    ("weights", r"Starting to load model "),
    ("weights", r"Loading model from scratch\.\.\."),
    ("weights", r"Loading drafter model\.\.\."),
    ("weights", r"Loading safetensors checkpoint shards"),
    ("weights", r"Loading weights took [\d.]+ seconds"),
    ("compile", r"Model loading took \S+ GiB"),
    ("compile", r"Dynamo bytecode transform time: "),
    ("compile", r"Compiling a graph for compile range "),
    ("compile", r"Directly load the compiled graph"),
    ("compile", r"torch\.compile took [\d.]+ s in total"),
    ("kv_cache", r"Available KV cache memory: "),
    ("kv_cache", r"GPU KV cache size: "),
    ("cuda_graphs", r"Capturing CUDA graphs"),
    ("cuda_graphs", r"Graph capturing finished in "),
    ("api", r"init engine \(profile, create kv cache, warmup model\) took"),
    ("api", r"Starting vLLM server on "),
    ("api", r"Available routes are:"),
    ("api", r"Application startup complete\."),
    ("flashinfer", r"^\[\d+/\d+\] \S.*flashinfer"),
))


def classify(line: str) -> str | None:
    """The phase a log line belongs to, or None for a line that names no phase."""
    for phase, rx in PATTERNS:
        if rx.search(line):
            return phase
    return None


def check_budgets(budgets: dict) -> dict[str, int]:
    """Defaults overridden by ``budgets``; ValueError (one line, naming the fix) on a bad entry."""
    out = dict(DEFAULT_BUDGETS)
    for key, value in (budgets or {}).items():
        if key not in out:
            raise ValueError(f"unknown phase {key!r} in the phase budgets; known: {', '.join(out)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"phase budget {key}={value!r} must be a positive number of seconds")
        out[key] = int(value)
    return out


class Tracker:
    """Follows one start: the current phase, when it began, the last progress, the phase's last lines."""

    def __init__(self, t0: float, budgets: dict | None = None, keep: int = 20) -> None:
        self.budgets = check_budgets(budgets or {})
        self.keep = keep
        self.phase = "start"
        self.resume = "start"  # the main phase a side phase (flashinfer) returns to
        self.phase_start = t0
        self.last_progress = t0
        self.t0 = t0
        self.history: list[dict] = []  # finished phases: {"phase", "start", "seconds"}
        self.tail: deque[str] = deque(maxlen=keep)
        self.restarted = False

    def _enter(self, phase: str, ts: float) -> dict:
        done = {"phase": self.phase, "start": self.phase_start, "seconds": round(ts - self.phase_start, 1)}
        self.history.append(done)
        self.phase, self.phase_start = phase, ts
        if phase in RANK:
            self.resume = phase
        self.tail.clear()
        return {"left": done, "entered": phase, "at": ts}

    def feed(self, line: str, ts: float) -> dict | None:
        """Take one line logged at ``ts``; returns the transition it made, if any."""
        self.last_progress = max(self.last_progress, ts)
        phase = classify(line)
        event = None
        if phase == "engine" and RANK[self.resume] > RANK["engine"]:
            self.restarted = True  # a second engine start: the server died and came back
        elif phase == "flashinfer":
            if self.phase != "flashinfer":
                event = self._enter("flashinfer", ts)
        elif phase is not None and (RANK[phase] > RANK[self.resume]
                                    or (self.phase == "flashinfer" and RANK[phase] >= RANK[self.resume])):
            event = self._enter(phase, ts)
        self.tail.append(line)
        return event

    def silent_for(self, now: float) -> float:
        return now - self.last_progress

    def stalled(self, now: float) -> bool:
        return self.silent_for(now) > self.budgets[self.phase]

    def finish(self, ts: float, final: str = "ready") -> dict:
        return self._enter(final, ts)

    def to_dict(self) -> dict:
        return {"budgets": self.budgets, "keep": self.keep, "phase": self.phase, "resume": self.resume,
                "phase_start": self.phase_start, "last_progress": self.last_progress, "t0": self.t0,
                "history": self.history, "tail": list(self.tail), "restarted": self.restarted}

    @classmethod
    def from_dict(cls, d: dict) -> Tracker:
        tr = cls(d["t0"], d["budgets"], d["keep"])
        tr.phase, tr.resume, tr.phase_start = d["phase"], d["resume"], d["phase_start"]
        tr.last_progress, tr.history, tr.restarted = d["last_progress"], list(d["history"]), d["restarted"]
        tr.tail.extend(d["tail"])
        return tr


def title(phase: str) -> str:
    return TITLES.get(phase, phase)
