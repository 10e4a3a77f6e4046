#!/usr/bin/env python3
"""Run every panel query of Grafana dashboard JSON files against a Prometheus (standard library).

    dashboard_queries.py --prometheus http://127.0.0.1:9090 [--rate-interval 30s] [--range-s 300]
                         [--step-s 5] --out results.json DASHBOARD.json...

For each panel's each target, the expression is taken from the JSON (never from a copied list), Grafana's
built-in ``$__rate_interval`` is replaced by --rate-interval (Grafana uses max(4 x scrape interval, the
step), a multi-value variable by its "All" value from the dashboard (``allValue``, the default selection);
any other ``$`` variable is refused, since Prometheus would not understand it), and the query runs
both as an instant query and as a range query over the last --range-s seconds. The results (status,
series, values) go to --out as JSON, written to a temporary file and renamed. The molecule scenario
``metrics`` asserts each returned data; ``tests/harness/dashboard_png.py`` draws the range results.
Exit status: 0 every query returned finite data, 1 one did not (listed on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

BUILTINS = ("$__rate_interval",)


def panel_queries(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    panels = list(dashboard.get("panels", []))
    for row in dashboard.get("panels", []):
        panels += row.get("panels", []) if row.get("type") == "row" else []
    for panel in panels:
        for t in panel.get("targets", []):
            if "expr" in t:
                out.append({"panel_id": panel.get("id"), "title": panel.get("title"), "unit":
                            (panel.get("fieldConfig") or {}).get("defaults", {}).get("unit"),
                            "ref_id": t.get("refId"), "expr": t["expr"], "legend": t.get("legendFormat", "")})
    return out


def all_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """What Grafana puts for each of the dashboard's multi-value variables when "All" is selected (its
    allValue, the default here), so that a panel query runs as the dashboard shows it by default."""
    return {v["name"]: v["allValue"] for v in (dashboard.get("templating") or {}).get("list", [])
            if v.get("includeAll") and isinstance(v.get("allValue"), str)}


def substitute(expr: str, rate_interval: str, variables: dict[str, str] | None = None) -> str:
    out = expr.replace("$__rate_interval", rate_interval)
    for name, value in (variables or {}).items():
        pattern = r"\$\{" + re.escape(name) + r"\}|\$" + re.escape(name) + r"\b"
        out = re.sub(pattern, lambda _m, v=value: v, out)
    left = re.findall(r"\$\{?[A-Za-z_][A-Za-z0-9_]*", out)
    if left:
        raise ValueError(f"query {expr!r} uses {left[0]}, which this tool cannot resolve "
                         f"(only {', '.join(BUILTINS)} and the dashboard's All values)")
    return out


def api(base: str, path: str, params: dict[str, str]) -> dict[str, Any]:
    url = base.rstrip("/") + path + "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    vals = []
    for series in result:
        pairs = series.get("values") or ([series["value"]] if "value" in series else [])
        vals += [float(v) for _, v in pairs]
    return [v for v in vals if math.isfinite(v)]


def run(base: str, dashboards: list[Path], rate_interval: str, range_s: int,
        step_s: int) -> list[dict[str, Any]]:
    now = time.time()
    rows = []
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        variables = all_values(dashboard)
        for q in panel_queries(dashboard):
            expr = substitute(q["expr"], rate_interval, variables)
            inst = api(base, "/api/v1/query", {"query": expr, "time": f"{now:.3f}"})
            rng = api(base, "/api/v1/query_range", {"query": expr, "start": f"{now - range_s:.3f}",
                                                      "end": f"{now:.3f}", "step": str(step_s)})
            rows.append({**q, "dashboard": path.name, "query": expr,
                         "instant": inst.get("data", {}).get("result", []),
                         "instant_status": inst.get("status"),
                         "range": rng.get("data", {}).get("result", []), "range_status": rng.get("status")})
    return rows


def problems(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        where = f"{r['dashboard']} panel {r['panel_id']} {r['title']!r} {r['ref_id']}"
        if r["instant_status"] != "success" or r["range_status"] != "success":
            out.append(f"{where}: query failed: {r['query']}")
        elif not finite_values(r["instant"]):
            out.append(f"{where}: no finite data now: {r['query']}")
        elif not finite_values(r["range"]):
            out.append(f"{where}: no finite data over the range: {r['query']}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", required=True)
    p.add_argument("--rate-interval", default="1m")
    p.add_argument("--range-s", type=int, default=300)
    p.add_argument("--step-s", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("dashboards", nargs="+", type=Path)
    args = p.parse_args(argv)
    missing = [str(d) for d in args.dashboards if not d.is_file()]
    if missing:
        p.error(f"no such dashboard file: {', '.join(missing)}")
    try:
        rows = run(args.prometheus, args.dashboards, args.rate_interval, args.range_s, args.step_s)
    except ValueError as exc:
        print(f"dashboard_queries: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"dashboard_queries: Prometheus at {args.prometheus} did not answer: {exc}", file=sys.stderr)
        return 1
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=args.out.name + ".")
    with os.fdopen(fd, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, args.out)
    bad = problems(rows)
    for line in bad:
        print(line, file=sys.stderr)
    print(f"dashboard_queries: {len(rows)} queries, {len(rows) - len(bad)} with data", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
