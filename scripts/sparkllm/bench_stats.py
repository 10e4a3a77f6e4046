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
