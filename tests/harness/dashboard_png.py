#!/usr/bin/env python3
"""Draw the dashboard's panels as one PNG from dashboard_queries.py's range results (matplotlib).

    .venv/bin/python tests/harness/dashboard_png.py RESULTS.json OUT.png [--title TEXT]

One subplot per panel, in the dashboard's order, one line per series, labelled with the target's
legendFormat (``{{label}}`` filled from the series' labels). No Grafana can be pulled on our
machines, so this chart stands in for a screenshot: the same queries, the same Prometheus data.
The molecule scenario ``metrics`` writes it from its own Prometheus (docs/dashboards/ keeps one).
Exit status: 0 written, 1 nothing to draw, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

SCALE = {"bytes": (1e-9, "GB"), "s": (1e3, "ms"), "percentunit": (100.0, "%"), "watt": (1.0, "W"),
         "hertz": (1e-6, "MHz"), "celsius": (1.0, "C")}


def legend(fmt: str, labels: dict[str, str], expr: str) -> str:
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in labels.items()) or expr[:40]
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def panels(rows: list[dict[str, Any]]) -> list[tuple[str, str | None, list[dict[str, Any]]]]:
    out: dict[tuple[str, Any], tuple[str, str | None, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (r["dashboard"], r["panel_id"])
        out.setdefault(key, (r["title"], r.get("unit"), []))[2].append(r)
    return list(out.values())


def draw(rows: list[dict[str, Any]], out: Path, title: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = panels(rows)
    if not groups:
        return 1
    cols = 2
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(13, 2.6 * nrows), squeeze=False)
    t0 = min((float(v[0]) for r in rows for s in r["range"] for v in s["values"]), default=0.0)
    for ax, (ptitle, unit, targets) in zip(axes.flat, groups, strict=False):
        factor, ulabel = SCALE.get(unit or "", (1.0, ""))
        for r in targets:
            for s in r["range"]:
                xs = [(float(t) - t0) / 60 for t, _ in s["values"]]
                ys = [float(v) * factor for _, v in s["values"]]
                ax.plot(xs, ys, linewidth=1.2, label=legend(r["legend"], s.get("metric", {}), r["query"]))
        ax.set_title(ptitle + (f" ({ulabel})" if ulabel else ""), fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("minutes", fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--title", default="Spark: vLLM serving (panel queries against Prometheus)")
    args = p.parse_args(argv)
    if not args.results.is_file():
        p.error(f"no such results file: {args.results}")
    rc = draw(json.loads(args.results.read_text()), args.out, args.title)
    if rc:
        print(f"dashboard_png: {args.results} holds no panel to draw", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
