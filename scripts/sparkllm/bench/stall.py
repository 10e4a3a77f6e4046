"""bench: an engine that stalls inside a measured run, and the requests much slower than their like (issue 46
item 4). Runs ON THE SPARK: standard library only.

**Stalls.** :class:`StallWatch` keeps the time of the engine's last sign of progress while a request is in
flight: a chunk that carried tokens on any stream, a request that ended, or a rise of the server's
``vllm:generation_tokens_total`` (read by the runner's /metrics sampler; the one sign a whole, non-streamed
request gives while it runs). vLLM adds a step's new tokens to that counter every engine step
(vllm/v1/metrics/stats.py:351, exported at vllm/v1/metrics/loggers.py:1126), so a decoding engine moves it
every step; prompt tokens are counted only when a request's first token is out (stats.py:352), so nothing
moves during a prefill. Hence two bounds: while some request in flight has had a token, ``stall_s`` of no
progress is a stall; while every request in flight still waits for its first token, the bound is at least
``PREFILL_ALLOWANCE`` times the longest first-token wait this run has seen (warm-up included: a depth run's
long prefill is not a stall). A stall of ``stall_s`` makes the run invalid; one of ``give_up_s`` ends it: the
requests in flight are cut off (their sockets shut), no further request is sent, and the runner writes what
was measured as a partial, invalid run.

**Outliers.** :func:`outliers` compares each answered request with the others of its category (the whole run
when a category has fewer than ``MIN_GROUP`` answers): a robust line e2e = a + b * output_tokens (Theil-Sen:
median of the pairwise slopes, median intercept), so a long answer is not slow because it is long; a request
whose excess over that line is beyond Tukey's far-out fence (Q3 + 3 IQR of the others' excesses; J. W. Tukey,
Exploratory Data Analysis, 1977) and also more than ``MIN_RATIO`` times its predicted time and more than
``MIN_EXCESS_S`` seconds over it is named in a warning. Open-loop (rate) runs are not judged: queueing behind
a burst is what they measure.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Defaults (bench.py run --stall-timeout / --stall-give-up; evidence in docs/benchmarks.md "Stalls"):
DEFAULT_STALL_S = 30.0  # ~400 tokens at the slowest public decode figure for this model on a GB10 (14 tok/s)
DEFAULT_GIVE_UP_S = 120.0  # past the 45 s wedge that recovered in the issue-46 campaign; well under 600 s
PREFILL_ALLOWANCE = 3.0  # x the longest first-token wait seen, while every request in flight is in prefill
MIN_GROUP = 4  # answers needed for a distribution to judge a request against
FENCE_K = 3.0  # Tukey's "far out" fence
MIN_RATIO = 3.0  # and more than this many times its predicted time ...
MIN_EXCESS_S = 1.0  # ... and this many seconds over it (timer and scheduling noise of a busy host)


@dataclass
class _Flight:
    conn: Any
    sent: float
    streamed: bool
    started: bool = False  # has had a token (or, for a whole request, the counter rose since it was sent)


@dataclass
class StallWatch:
    stall_s: float = DEFAULT_STALL_S
    give_up_s: float = DEFAULT_GIVE_UP_S
    clock: Callable[[], float] = time.monotonic
    flights: dict[int, _Flight] = field(default_factory=dict)
    last: float = 0.0  # the last sign of progress
    counter: float | None = None  # vllm:generation_tokens_total at the last reading
    counter_at: float | None = None  # when /metrics last answered
    longest_wait: float = 0.0  # longest first-token wait seen (whole requests: their e2e time)
    stalls: list[dict[str, Any]] = field(default_factory=list)
    gave_up: dict[str, Any] | None = None
    unmeasured: set[int] = field(default_factory=set)  # cut off, or not sent after giving up

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.last = self.clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- fed by the client (bench_client) and the /metrics sampler (bench_runner.RunningSampler)
    def begin(self, res: Any, conn: Any, streamed: bool) -> bool:
        """A request is about to be sent; False (and the request marked not sent) after giving up."""
        with self.lock:
            if self.gave_up is not None:
                res.error = f"not sent: {self.gave_up['reason']}"
                self.unmeasured.add(id(res))
                return False
            now = self.clock()
            if not self._watched():
                self.last = now  # nothing was in flight: the clock starts now
            self.flights[id(res)] = _Flight(conn, now, streamed)
            return True

    def token(self, res: Any) -> None:
        with self.lock:
            self._progress()
            f = self.flights.get(id(res))
            if f is not None:
                f.started = True

    def end(self, res: Any) -> None:
        with self.lock:
            f = self.flights.pop(id(res), None)
            if f is None:
                return
            if id(res) in self.unmeasured:
                res.ok = False
                res.error = f"cut off: {self.gave_up['reason'] if self.gave_up else 'gave up'}"
                return
            if res.ok:
                wait = res.ttft_s if f.streamed else res.e2e_s
                self.longest_wait = max(self.longest_wait, wait or 0.0)
            self._progress()

    def counter_reading(self, value: float | None) -> None:
        """vllm:generation_tokens_total as /metrics gave it (None: no reading)."""
        with self.lock:
            if value is None:
                return
            self.counter_at = self.clock()
            if self.counter is not None and value > self.counter:
                self._progress()
                for f in self.flights.values():
                    if not f.streamed and f.sent < self.counter_at:
                        f.started = True
            self.counter = value

    def saw(self, results: Iterable[Any]) -> None:
        """Warm-up requests: their first-token waits size the prefill allowance of the measured phase."""
        with self.lock:
            for r in results:
                if r.ok:
                    wait = r.ttft_s if r.t_end is None else r.e2e_s
                    self.longest_wait = max(self.longest_wait, wait or 0.0)

    # ---- judged by the watch's own thread
    def bounds(self) -> tuple[float, float]:
        """(stall, give-up) bounds now: larger while every request in flight waits for its first token."""
        if any(f.started for f in self._live()):
            return self.stall_s, self.give_up_s
        allow = PREFILL_ALLOWANCE * self.longest_wait
        return max(self.stall_s, allow), max(self.give_up_s, allow)

    def check(self) -> None:
        with self.lock:
            live = self._live()
            if not live:
                return
            now = self.clock()
            gap = now - self.last
            stall, give_up = self.bounds()
            if gap < stall:
                return
            cur = self.stalls[-1] if self.stalls and self.stalls[-1]["start"] == self.last else None
            if cur is None:
                cur = {"start": self.last, "seconds": gap, "in_flight": len(live), "bound_s": stall}
                self.stalls.append(cur)
            cur["seconds"], cur["in_flight"] = gap, max(cur["in_flight"], len(live))
            if gap >= give_up and self.gave_up is None:
                self.gave_up = {"seconds": gap, "in_flight": len(live), "bound_s": give_up,
                                "reason": f"the engine made no progress for {gap:.0f} s"}
                for rid, f in self.flights.items():
                    self.unmeasured.add(rid)
                    _cut(f.conn)

    def start(self) -> StallWatch:
        tick = max(0.02, min(0.5, self.stall_s / 10))

        def loop() -> None:
            while not self._stop.wait(tick):
                self.check()

        self._thread = threading.Thread(target=loop, daemon=True, name="stall-watch")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # ---- what the run document says
    def problems(self) -> list[str]:
        """One line per stall (the run is invalid with any); empty when the engine never stalled."""
        if self.gave_up is not None:
            return []  # the runner says it once, with the requests measured
        return [stall_line(s["seconds"], s["in_flight"]) + f"; --stall-timeout {self.stall_s:g} s)"
                for s in self.stalls]

    def gave_up_line(self, measured: int, planned: int) -> str:
        g = self.gave_up or {}
        return (stall_line(g.get("seconds", 0.0), g.get("in_flight", 0)) + f"): gave up after {measured} of "
                f"{planned} requests (--stall-give-up {self.give_up_s:g} s)")

    def summary(self) -> dict[str, Any]:
        return {"stall_timeout_s": self.stall_s, "give_up_s": self.give_up_s,
                "stalls": [{"seconds": round(s["seconds"], 3), "in_flight": s["in_flight"],
                            "bound_s": s["bound_s"]} for s in self.stalls],
                "gave_up": self.gave_up is not None, "longest_first_token_wait_s": self.longest_wait}

    # ---- internals (lock held)
    def _live(self) -> list[_Flight]:
        """The requests in flight the watch can judge: a whole request only while /metrics answers (its one
        sign of progress); without /metrics the run is invalid anyway."""
        fresh = self.counter_at is not None and self.clock() - self.counter_at < max(5.0, self.stall_s / 2)
        return [f for f in self.flights.values() if f.streamed or fresh]

    def _watched(self) -> bool:
        return bool(self._live())

    def _progress(self) -> None:
        now = self.clock()
        if self.stalls and self.stalls[-1]["start"] == self.last:  # a stall ends: its full length
            self.stalls[-1]["seconds"] = now - self.last
        self.last = now


def stall_line(seconds: float, in_flight: int) -> str:
    return (f"engine stalled {seconds:.1f} s during the measured phase (no token, no rise of "
            f"vllm:generation_tokens_total, with {in_flight} request(s) in flight")


def _cut(conn: Any) -> None:
    """Unblock the thread reading this connection (it sees the stream end)."""
    sock = getattr(conn, "sock", None)
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


# ---------------------------------------------------------------------------------------------------------
def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Theil-Sen: (intercept, slope) of y on x, robust to a few wild points."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:]
              if x2 != x1]
    b = statistics.median(slopes) if slopes else 0.0
    return statistics.median(y - b * x for x, y in points), b


def outliers(results: Iterable[Any]) -> list[dict[str, Any]]:
    """Answered requests much slower than their like (module docstring); one dict per request."""
    ok = [r for r in results if r.ok and r.e2e_s is not None and r.output_tokens]
    groups: dict[str, list[Any]] = {}
    for r in ok:
        groups.setdefault(r.category, []).append(r)
    small = [r for rs in groups.values() if len(rs) < MIN_GROUP for r in rs]
    small_ids = {id(r) for r in small}
    judged = [(cat, rs) for cat, rs in groups.items() if len(rs) >= MIN_GROUP]
    if small and len(ok) >= MIN_GROUP:
        judged.append(("the run", ok))  # small categories against every request of the run
    found: dict[int, dict[str, Any]] = {}
    for like, rs in judged:
        a, b = _line([(float(r.output_tokens), r.e2e_s) for r in rs])
        excess = [r.e2e_s - (a + b * r.output_tokens) for r in rs]
        for i, (r, x) in enumerate(zip(rs, excess, strict=True)):
            if like == "the run" and id(r) not in small_ids:
                continue
            q1, q3 = _quartiles(excess[:i] + excess[i + 1:])  # the fence of the others
            fence = q3 + FENCE_K * (q3 - q1)
            pred = r.e2e_s - x
            if x > fence and x > MIN_EXCESS_S and r.e2e_s > MIN_RATIO * max(pred, 1e-9):
                found[id(r)] = {"idx": r.idx, "prompt_id": r.prompt_id, "category": r.category,
                                "repeat": r.repeat, "e2e_s": r.e2e_s, "expected_s": pred,
                                "compared_with": like}
    return sorted(found.values(), key=lambda o: o["idx"])


def outlier_warning(o: dict[str, Any]) -> str:
    like = "its category" if o["compared_with"] != "the run" else "the run"
    return (f"request {o['idx']} ({o['prompt_id']}, repeat {o['repeat']}) took {o['e2e_s']:.2f} s against "
            f"{o['expected_s']:.2f} s expected from {like}'s other requests of its length: an outlier "
            "(a stall of the engine or of this host?)")
