"""bench: the request-rate mode (standard library only; runs on the Spark).

Open-loop load: requests arrive as a Poisson process of rate ``λ`` requests/s, i.e. exponential gaps
of mean ``1/λ`` drawn from ``random.Random(arrival_seed)``, so one seed gives the same schedule on every
host and every method, and the schedules of two rates are one schedule scaled in time (``arrivals``).
Each request is sent when it is due, whatever is still in flight (``run_open_loop``); a request that
the server queues waits there, and its TTFT grows. That is why a
concurrency level has no meaning in a rate run: ``bench.py run`` refuses both at once.

Goodput (``goodput``): the requests that answered and met every target given with ``--goodput``
(``ttft``, ``tpot``, ``e2e``; e.g. ``ttft=2000ms,tpot=100ms``), as a share of all measured requests and
as a rate, requests/s over the measured phase's wall time. A request with one output token has no TPOT
and meets a TPOT target.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sparkllm.bench.common import UsageError

# target name -> (the request row's field, factor from milliseconds to that field's unit)
GOODPUT_TARGETS = {"ttft": ("ttft_s", 1e-3), "tpot": ("tpot_ms", 1.0), "e2e": ("e2e_s", 1e-3)}


def rate_list(text: str) -> list[float]:
    """``0.5,1,2`` -> [0.5, 1.0, 2.0] requests/s; UsageError for anything else."""
    fix = "e.g. --request-rate 0.5,1,2 (requests per second, each > 0)"
    items = str(text).split(",")
    if len(items) > 1 and any(not x.strip() for x in items):
        raise UsageError(f"--request-rate {text!r}: an empty item (two commas, or one at an end), {fix}")
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--request-rate {text!r}: expected comma-separated numbers, {fix}") from None
    if not vals:
        raise UsageError(f"--request-rate {text!r}: no rate given, {fix}")
    bad = [v for v in vals if not (v > 0 and v < float("inf"))]
    if bad:
        raise UsageError(f"--request-rate {text!r}: {bad[0]:g} is not a positive finite rate, {fix}")
    if len(set(vals)) != len(vals):
        raise UsageError(f"--request-rate {text!r}: a rate is listed twice, {fix}")
    return vals


def _ms(name: str, text: str) -> float:
    t = text.strip().lower()
    scale = 1.0
    if t.endswith("ms"):
        t = t[:-2]
    elif t.endswith("s"):
        t, scale = t[:-1], 1000.0
    try:
        v = float(t) * scale
    except ValueError:
        raise UsageError(f"--goodput {name}={text}: not a time; write e.g. {name}=2000ms or "
                         f"{name}=2s") from None
    if not v > 0:
        raise UsageError(f"--goodput {name}={text}: a target must be > 0")
    return v


def parse_goodput(text: str | None) -> dict[str, float]:
    """``ttft=2000ms,tpot=100ms`` -> {"ttft": 2000.0, "tpot": 100.0} (milliseconds; bare numbers are ms)."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for item in (x for x in text.split(",") if x.strip()):
        name, eq, val = item.partition("=")
        name = name.strip().lower()
        if not eq or not val.strip():
            raise UsageError(f"--goodput {item!r}: write NAME=TIME, e.g. --goodput ttft=2000ms,tpot=100ms")
        if name not in GOODPUT_TARGETS:
            raise UsageError(f"--goodput {item!r}: unknown target {name!r}; use "
                             f"{', '.join(GOODPUT_TARGETS)} (e.g. ttft=2000ms,tpot=100ms)")
        if name in out:
            raise UsageError(f"--goodput: target {name!r} given twice")
        out[name] = _ms(name, val)
    if not out:
        raise UsageError("--goodput is empty; write e.g. --goodput ttft=2000ms,tpot=100ms")
    return out


def arrivals(rate: float, seed: int, *, num: int | None = None, duration: float | None = None) -> list[float]:
    """Arrival offsets in seconds from the start of the measured phase: the first ``num`` of a seeded
    Poisson process of ``rate``/s, or every arrival before ``duration`` seconds (at least one)."""
    if (num is None) == (duration is None):
        raise ValueError("give exactly one of num and duration")
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if num is not None and len(out) >= num:
            break
        if duration is not None and t >= duration and out:
            break
        out.append(t)
    return out


def meets(row: dict[str, Any], targets: dict[str, float]) -> bool:
    """Did this request (a run document's request row) answer and meet every target?"""
    if not row.get("ok"):
        return False
    for name, limit_ms in targets.items():
        key, factor = GOODPUT_TARGETS[name]
        v = row.get(key)
        if v is None:
            if name == "tpot" and (row.get("output_tokens") or 0) <= 1:
                continue  # no decode, no TPOT
            return False
        if v > limit_ms * factor:
            return False
    return True


def goodput(rows: Sequence[dict[str, Any]], targets: dict[str, float],
            wall_s: float) -> dict[str, Any] | None:
    """Share and rate of the requests meeting every target; None without targets."""
    if not targets:
        return None
    met = sum(1 for r in rows if meets(r, targets))
    n = len(rows)
    return {"targets_ms": dict(targets), "requests": n, "met": met, "share": met / n if n else None,
            "rate_req_s": met / wall_s if wall_s > 0 else None}


def run_open_loop(offsets: Sequence[float], send: Callable[[int], None]) -> dict[str, Any]:
    """Call ``send(i)`` in its own thread at ``offsets[i]`` seconds after the start; wait for all.
    Returns the dispatch lags (actual - planned start, seconds) and the most requests in flight."""
    lags: list[float] = [0.0] * len(offsets)
    lock = threading.Lock()
    state = {"in_flight": 0, "max_in_flight": 0}

    def one(i: int) -> None:
        with lock:
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            send(i)
        finally:
            with lock:
                state["in_flight"] -= 1

    t0 = time.monotonic()
    threads = []
    for i, off in enumerate(offsets):
        while (dt := t0 + off - time.monotonic()) > 0:
            time.sleep(dt)
        lags[i] = time.monotonic() - (t0 + off)
        th = threading.Thread(target=one, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return {"lags_s": lags, "max_in_flight": state["max_in_flight"]}
