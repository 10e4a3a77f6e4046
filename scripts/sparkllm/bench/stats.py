"""bench: statistics (percentiles, t-intervals, the i.i.d. acceptance fit; standard library only)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

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


# --- the outputs verdict: a one-sided exact binomial test (docs/benchmarks.md) ---------------------------
VERDICT_ALPHA = 0.01  # false-alarm rate of "outputs differ" for a method at the floor (at most)
VERDICT_ALLOWANCE = 0.01  # the smallest mismatch share the null allows (a floor of 1.00 is a floor of 0.99)
DETECT_POWER = 0.95  # "detects an error share" means: flags it with at least this probability


def binom_tail(n: int, p: float, x: int) -> float:
    """P(X >= x) for X ~ Binomial(n, p), exactly (summed in log space, so any n works)."""
    if x <= 0:
        return 1.0
    if x > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq
             for k in range(x, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


def null_share(floor_mismatch: float | None) -> float:
    """The mismatch share a method at the floor shows: the floor's own, at least the allowance."""
    return max(VERDICT_ALLOWANCE, floor_mismatch or 0.0)


def critical_count(n: int, p0: float, alpha: float = VERDICT_ALPHA) -> int:
    """The fewest differing prompts out of n that say "outputs differ" (P(X >= c | p0) <= alpha);
    n + 1 when no count can."""
    for c in range(n + 1):
        if binom_tail(n, p0, c) <= alpha:
            return c
    return n + 1


def miss_rate(n: int, error_share: float, floor_mismatch: float | None = None,
              alpha: float = VERDICT_ALPHA) -> float:
    """Probability that a method wrong on ``error_share`` of the prompts (on top of the floor's own
    mismatches) is NOT flagged with n prompts compared."""
    p0 = null_share(floor_mismatch)
    p1 = p0 + error_share * (1.0 - p0)
    return 1.0 - binom_tail(n, p1, critical_count(n, p0, alpha))


def prompts_needed(error_share: float, floor_mismatch: float | None = None, alpha: float = VERDICT_ALPHA,
                   power: float = DETECT_POWER, limit: int = 5000) -> int | None:
    """The fewest prompts with which an error share is flagged with probability >= power (None: more
    than ``limit``)."""
    for n in range(1, limit + 1):
        if miss_rate(n, error_share, floor_mismatch, alpha) <= 1.0 - power:
            return n
    return None
