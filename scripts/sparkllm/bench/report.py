"""bench: the Markdown report and PNG charts from a results store (controller only;
matplotlib imported lazily, so a Python without it still writes the Markdown)."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparkllm.bench import analysis as bench_analysis
from sparkllm.bench import ceiling as bench_ceiling
from sparkllm.bench import records as bench_records
from sparkllm.bench.common import REPORT_DIRNAME, UsageError, fmt, utc_now
from sparkllm.bench.stats import describe, t975
from sparkllm.bench.store import STORE_NAME, import_runs, open_store, record_output_checks

REPORT_TOOL = "bench.py report"
CHART_FILES = ("decode_tok_s.png", "acceptance_by_position.png", "speedup_by_category.png",
               "tok_s_vs_concurrency.png", "goodput_vs_rate.png")
NO_MATPLOTLIB = ("Charts need matplotlib, which this Python lacks: run `bench.py report` with the toolkit's "
                 "venv (`make setup`, then `.venv/bin/python scripts/bench.py report DIR`).")




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
        """What a comparison must hold equal: load, token budget, sampling, model and its checkpoint (the
        manifest's sha256 the serve stage records), prompts, topology."""
        m = self.doc.get("meta", {})
        s = m.get("sampling") or {}
        p = m.get("prompts") or {}
        ctx = {"concurrency": m.get("concurrency"), "max_tokens": s.get("max_tokens"),
               "temperature": s.get("temperature"), "thinking": s.get("thinking"), "model": m.get("model"),
               "prompts": p.get("sha256"), "categories": p.get("category_filter"),
               "topology": m.get("topology"), "input_depth": m.get("input_depth") or None,
               "request_rate": m.get("request_rate"), "goodput_targets": m.get("goodput_targets_ms"),
               "checkpoint": m.get("model_manifest_sha256"), "profile": m.get("profile") or "decode"}
        if m.get("input_depth"):  # a depth built from another text is another context
            ctx["filler"] = (m.get("depth") or {}).get("filler_sha256")
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
        # a row's figure per request: decode tok/s (decode profile), else the records' end-to-end tok/s
        reqs = conn.execute("SELECT q.run_id, q.category, CASE WHEN coalesce(r.profile, 'decode') = 'decode' "
                            "THEN q.decode_tok_s ELSE q.e2e_tok_s END AS tok_s FROM requests q JOIN runs r "
                            "ON r.run_id = q.run_id WHERE q.ok = 1").fetchall()
    finally:
        conn.close()
    dec: dict[str, list[float]] = {}
    cats: dict[str, dict[str, list[float]]] = {}
    for r in reqs:
        if r["tok_s"] is None:
            continue
        dec.setdefault(r["run_id"], []).append(r["tok_s"])
        cats.setdefault(r["run_id"], {}).setdefault(r["category"], []).append(r["tok_s"])
    out = []
    for r in rows:
        doc = json.loads(r["doc"])
        median = r["decode_tok_s_median"]
        if (doc.get("meta") or {}).get("profile") in ("records", "agent"):
            # the run's figure: the records' mean over passes (agent: the median request)
            median = ((doc.get("records") or {}).get("tok_s_mean")
                      or ((doc.get("summary") or {}).get("e2e_tok_s") or {}).get("median"))
        out.append(RunRow(r["run_id"], r["label"], bool(r["valid"]), json.loads(r["problems"]),
                          r["repetition"], r["started_utc"], median, doc, dec.get(r["run_id"], []),
                          cats.get(r["run_id"], {})))
    return out


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
    method: str | None = None
    k: int | None = None
    aggregate_tok_s: float | None = None  # output tokens / wall time of the measured phase, mean of runs
    ttft: dict[str, Any] = field(default_factory=dict)
    tpot: dict[str, Any] = field(default_factory=dict)
    itl: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: float | None = None
    prefill_tok_s: float | None = None
    acc_rate: float | None = None
    cat_acceptance: dict[str, float] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] | None = None  # the check against the baseline (bench_analysis)
    differs: bool = False
    rate: dict[str, Any] | None = None  # request-rate rows: completed rate and goodput, mean of the runs


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
    """The label, with what tells rows apart: the concurrency (``c=N``) and input depth (``d=N``) when
    the store holds several, the offered rate (``r=R``) of a request-rate row, then the configuration
    hash when a label still names several groups."""
    ctxs = {k: json.loads(k[2]) for k in keys}
    vary = [f for f in ("concurrency", "input_depth") if len({str(c.get(f)) for c in ctxs.values()}) > 1]
    profiled = len({c.get("profile") or "decode" for c in ctxs.values()}) > 1

    def tags(c: dict[str, Any]) -> list[str]:
        closed = c.get("request_rate") is None
        out = [f"c={c.get('concurrency') or 0}"] if "concurrency" in vary and closed else []
        out += [f"r={float(c['request_rate']):g}"] if c.get("request_rate") is not None else []
        out += [f"d={c.get('input_depth') or 0}"] if "input_depth" in vary else []
        return out + ([str(c.get("profile") or "decode")] if profiled else [])

    base = {k: " ".join([k[0], *tags(ctxs[k])]) for k in keys}
    by_name: dict[str, list[tuple]] = {}
    for k in keys:
        by_name.setdefault(base[k], []).append(k)
    names: dict[tuple, str] = {}
    for name, ks in by_name.items():
        if len(ks) == 1:
            names[ks[0]] = name
            continue
        for n, k in enumerate(ks, 1):
            names[k] = f"{name} [{k[1][:12]}]" if k[1] and sum(x[1] == k[1] for x in ks) == 1 else (
                f"{name} [config {n}]")
    return names


def _pooled(rs: list[RunRow], key: str) -> dict[str, Any]:
    return describe(q.get(key) for r in rs for q in r.doc.get("requests") or [] if q.get("ok"))


def _itl(rs: list[RunRow]) -> dict[str, Any]:
    icl = [r.doc["summary"].get("icl_ms") or {} for r in rs]
    return {q: _mean_opt(d.get(q) for d in icl) for q in ("median", "p95", "p99")}


def _cat_acceptance(rs: list[RunRow]) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for r in rs:
        for c, v in (r.doc.get("categories") or {}).items():
            a = (v.get("spec") or {}).get("acceptance_rate")
            if a is not None:
                out.setdefault(c, []).append(a)
    return {c: statistics.fmean(v) for c, v in out.items()}


def _telemetry(rs: list[RunRow]) -> dict[str, Any]:
    ts = [r.doc.get("telemetry") or {} for r in rs]
    out: dict[str, Any] = {k: _mean_opt(t.get(k) for t in ts) for k in ("j_per_output_token", "power_w_mean")}
    temps = [t["temp_c_max"] for t in ts if t.get("temp_c_max") is not None]
    lo = [t["sm_clock_mhz_min"] for t in ts if t.get("sm_clock_mhz_min") is not None]
    hi = [t["sm_clock_mhz_max"] for t in ts if t.get("sm_clock_mhz_max") is not None]
    out.update(temp_c_max=max(temps) if temps else None, sm_clock_mhz_min=min(lo) if lo else None,
               sm_clock_mhz_max=max(hi) if hi else None,
               warnings=sorted({w for t in ts for w in t.get("warnings") or []}),
               note=next((t["note"] for t in ts if t.get("note")), None if ts and any(ts) else
                         "no telemetry recorded (runs before schema 2)"))
    return out


def _rate(rs: list[RunRow]) -> dict[str, Any] | None:
    rates = [r.doc.get("meta", {}).get("rate") for r in rs]
    if not any(rates):
        return None
    gps = [r.doc["summary"].get("goodput") or {} for r in rs]
    return {"completed_rate_req_s": _mean_opt((x or {}).get("completed_rate_req_s") for x in rates),
            "offered_rate_req_s": _mean_opt((x or {}).get("offered_rate_req_s") for x in rates),
            "requests": sum(r.doc["summary"].get("requests") or 0 for r in rs),
            "goodput_share": _mean_opt(g.get("share") for g in gps),
            "goodput_req_s": _mean_opt(g.get("rate_req_s") for g in gps)}


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
            baseline_row=names[bkey] if bkey is not None else None,
            method=rs[0].doc.get("meta", {}).get("method"),
            k=rs[0].doc.get("spec", {}).get("num_speculative_tokens"),
            aggregate_tok_s=_mean_opt((r.doc["summary"].get("token_weighted") or {}).get("output_tok_s_wall")
                                      for r in rs),
            ttft=_pooled(rs, "ttft_s"), tpot=_pooled(rs, "tpot_ms"), itl=_itl(rs),
            prompt_tokens=_pooled(rs, "prompt_tokens")["median"],
            prefill_tok_s=_pooled(rs, "prefill_tok_s")["median"],
            acc_rate=_mean_opt(r.doc["spec"].get("acceptance_rate") for r in rs),
            cat_acceptance=_cat_acceptance(rs), telemetry=_telemetry(rs), rate=_rate(rs)))
    out.sort(key=lambda m: (json.loads(m.context).get("request_rate") is not None,
                            json.loads(m.context).get("request_rate") or 0,
                            json.loads(m.context).get("concurrency") or 1,
                            json.loads(m.context).get("input_depth") or 0,
                            m.base_label != baseline, -(m.decode["median"] or 0)))
    return out


def _distinct(runs: Sequence[RunRow], key: str, width: int = 0) -> str:
    vals = sorted({str(v)[:width] if width else str(v) for r in runs
                   if (v := r.doc.get("meta", {}).get(key)) not in (None, "")})
    return ", ".join(f"`{v}`" for v in vals) if vals else "-"


def provenance_lines(stats: Sequence[MethodStats]) -> list[str]:
    """What each row measured: the model's revision (the commit the fetch was locked to), the toolkit's
    commit on the controller and the server image, from the runs' meta; several values in one cell mean
    the row pooled runs of several (possible only for keys the configuration hash leaves out)."""
    if not stats:
        return []
    lines = ["", "## Provenance", "", "| row | model revision | toolkit commit | image |",
             "|---|---|---|---|"]
    lines += [f"| {m.label} | {_distinct(m.runs, 'model_revision')} "
              f"| {_distinct(m.runs, 'toolkit_commit', 12)} | {_distinct(m.runs, 'image')} |" for m in stats]
    return lines


def render_markdown(stats: list[MethodStats], invalid: list[RunRow], baseline: str, charts: list[str],
                    notes: Sequence[str] = ()) -> str:
    lines = ["# Speculative decoding benchmark report", "",
             f"Generated {utc_now()}. tok/s is per request: decode tok/s, (n-1)/decode time, for rows of "
             "the decode profile; end-to-end tok/s, completion tokens / request time with prefill, for rows "
             "of the records and agent profiles (tagged so when a store holds several); pooled over the "
             "valid runs of each method. Speedup = geometric mean of paired run-median ratios vs "
             f"`{baseline}` (pairs by repetition index, else closest start time) with a 95 % t-interval. "
             "\"Peak\" is only the labelled p95/max of per-request decode tok/s.", "",
             *bench_analysis.recommendation_lines(stats, baseline), "",
             *bench_records.table_lines(stats),
             "## Method comparison", "",
             "| method | runs | requests | tok/s median | p5-p95 | mean (95% CI of run medians) | CV "
             "| peak (p95 / max) | speedup vs baseline [95% CI] | TTFT median s | mean acceptance length "
             "| per-position acceptance |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    bad = bench_analysis._differing(stats)
    for m in stats:
        d, rm, sp = m.decode, m.run_medians, m.speedup
        # a configuration whose outputs differ has no peak worth the name (a garbler's fastest request)
        peak = ("- (outputs differ: no peak)" if (m.base_label, m.config_hash) in bad
                else f"{fmt(d['p95'])} / {fmt(d['max'])}")
        speed = "1 (reference)" if m.base_label == baseline else (
            "- (no baseline run in the same context)" if m.baseline_row is None else "-"
        ) if sp["gmean"] is None else (
            f"{sp['gmean']:.3f}x"
            + (f" [{sp['ci95_low']:.3f}-{sp['ci95_high']:.3f}]" if sp["ci95_low"] else "")
            + f" (n={sp['pairs']})")
        ci = fmt(rm["mean"]) + (f" ({fmt(rm['ci95_low'])}-{fmt(rm['ci95_high'])})"
                                 if rm["ci95_low"] is not None else " (1 run: no interval)")
        pp = "/".join(f"{x:.2f}" for x in m.per_position) if m.per_position else "-"
        lines.append(f"| {m.label} | {len(m.runs)} | {d['n']} | {fmt(d['median'])} | {fmt(d['p5'])}-"
                     f"{fmt(d['p95'])} | {ci} | {fmt(rm['cv'], 3)} | {peak} "
                     f"| {speed} | {fmt(m.ttft_median, 3)} | {fmt(m.acc_len)} | {pp} |")
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
                cells.append(f"{fmt(v)}{ratio}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if len({m.context for m in stats}) > 1 or len(rows) != len({m.base_label for m in stats}):
        lines += ["", "## Configurations (rows are never pooled across these; speedups compare a row with "
                  "the baseline row of the same context)", "",
                  "| row | configuration hash | compared with | context |", "|---|---|---|---|"]
        lines += [f"| {m.label} | {m.config_hash or '-'} | {m.baseline_row or '-'} | `{m.context}` |"
                  for m in stats]
    lines += bench_analysis.tables(stats, baseline)
    lines += bench_ceiling.table_lines(stats)
    lines += provenance_lines(stats)
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


def _mark(m: MethodStats, bad: set[tuple[str, str | None]], baseline: str) -> str:
    """What a chart says beside a row: its configuration's outputs differ (at any load point), or were
    never checked."""
    if (m.base_label, m.config_hash) in bad:
        return " [outputs differ]"
    return "" if bench_analysis.checked(m, baseline) else " [not checked]"


# red is the colour of "[outputs differ]" (docs/benchmarks.md, "Where the verdict shows"); every other series
# takes matplotlib's default cycle without its red (C3), which a fourth method used to get
SERIES_COLOURS = tuple(f"C{i}" for i in range(10) if i != 3)


def _colour(j: int, mark: str) -> str:
    return "red" if "differ" in mark else SERIES_COLOURS[j % len(SERIES_COLOURS)]


def _save(fig: Any, plt: Any, path: Path) -> None:
    """Legends sit outside the axes (they cover nothing); the saved image grows to hold them."""
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _legend(ax: Any) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, borderaxespad=0.0)


def render_charts(stats: list[MethodStats], baseline: str, out: Path) -> list[str]:
    import matplotlib  # controller only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bad = bench_analysis._differing(stats)
    names: list[str] = []
    labels = [m.label + _mark(m, bad, baseline) for m in stats]
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(stats)), 4))
    data = [[x for r in m.runs for x in r.decode] or [0.0] for m in stats]
    ax.boxplot(data, whis=(5, 95), showmeans=True)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30 if len(stats) > 3 else 0, ha="right")
    for tick, m in zip(ax.get_xticklabels(), stats, strict=True):
        if (m.base_label, m.config_hash) in bad:
            tick.set_color("red")
    ax.set_ylabel("decode tok/s per request\n(whiskers p5-p95)")
    ax.set_title("Decode speed distribution per method")
    _save(fig, plt, out / "decode_tok_s.png")
    names.append("decode_tok_s.png")
    # one line per configuration (its rows at every load point averaged): per-position acceptance is a
    # property of the drafter, and one line per row drew several lines on top of each other
    fig, ax = plt.subplots(figsize=(5, 4))
    lines: dict[tuple[str, str | None], list[MethodStats]] = {}
    for m in stats:
        if m.per_position:
            lines.setdefault((m.base_label, m.config_hash), []).append(m)
    longest = 1
    for j, ((label, _), ms) in enumerate(lines.items()):
        pos = _mean_positions([m.per_position for m in ms]) or []
        longest = max(longest, len(pos))
        mark = _mark(ms[0], bad, baseline)
        ax.plot(range(1, len(pos) + 1), pos, marker="o", label=label + mark, color=_colour(j, mark),
                **({"ls": "--"} if "differ" in mark else {}))
    ax.set_xlabel("draft position")
    ax.set_xticks(range(1, longest + 1))
    ax.set_ylabel("acceptance p_i = A_i / N")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by position")
    if lines:  # a chart with nothing drawn (no drafter's acceptance) is neither written nor linked
        _legend(ax)
        _save(fig, plt, out / "acceptance_by_position.png")
        names.append("acceptance_by_position.png")
    else:
        plt.close(fig)
    rows = {m.label: m for m in stats}
    cats = sorted({c for m in stats for c in m.by_cat})
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(cats) + 2), 4))
    others = [m for m in stats if m.base_label != baseline]
    width = 0.8 / max(1, len(others))
    drawn = False
    for j, m in enumerate(others):
        base = rows.get(m.baseline_row) if m.baseline_row else None
        ys = [(m.by_cat.get(c) or 0) / b if base and (b := base.by_cat.get(c)) else 0 for c in cats]
        drawn = drawn or any(ys)
        mark = _mark(m, bad, baseline)
        ax.bar([i + j * width for i in range(len(cats))], ys, width, label=m.label + mark,
               color=_colour(j, mark),
               **({"hatch": "//", "edgecolor": "black"} if "differ" in mark else {}))
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel(f"speedup vs {baseline} (category medians)")
    ax.set_title("Speedup per category")
    if drawn:  # no row with a baseline to compare with: nothing to draw, nothing written or linked
        _legend(ax)
        _save(fig, plt, out / "speedup_by_category.png")
        names.append("speedup_by_category.png")
    else:
        plt.close(fig)
    closed = [m for m in stats if json.loads(m.context).get("request_rate") is None]
    if len({json.loads(m.context).get("concurrency") for m in closed}) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        series: dict[str, list[tuple[int, float | None, float | None]]] = {}
        for m in closed:
            c = json.loads(m.context)
            name = (f"{m.base_label}" + (f" d={c['input_depth']}" if c.get("input_depth") else "")
                    + _mark(m, bad, baseline))
            point = (c.get("concurrency") or 1, m.decode["median"], m.aggregate_tok_s)
            series.setdefault(name, []).append(point)
        for j, (name, pts) in enumerate(sorted(series.items())):
            pts.sort()
            color = _colour(j, name)
            ax.plot([p[0] for p in pts], [p[1] or 0 for p in pts], marker="o", color=color,
                    label=f"{name} per stream")
            ax.plot([p[0] for p in pts], [p[2] or 0 for p in pts], marker="s", ls="--", color=color,
                    label=f"{name} aggregate")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("decode tok/s")
        ax.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
        ax.set_title("tok/s against concurrency")
        _legend(ax)
        _save(fig, plt, out / "tok_s_vs_concurrency.png")
        names.append("tok_s_vs_concurrency.png")
    rated = [m for m in stats if json.loads(m.context).get("request_rate") is not None]
    if _goodput_chart(plt, rated, out, bad, baseline):
        names.append("goodput_vs_rate.png")
    return names


def _goodput_chart(plt: Any, rated: list[MethodStats], out: Path, bad: set[tuple[str, str | None]],
                   baseline: str) -> bool:
    """Goodput (completed rate without targets) against the offered rate, one line per method and depth;
    only when two rates or more were measured."""
    if len({json.loads(m.context)["request_rate"] for m in rated}) < 2:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[float, float]]] = {}
    for m in rated:
        c, r = json.loads(m.context), m.rate or {}
        g = r.get("goodput_req_s") if c.get("goodput_targets") else r.get("completed_rate_req_s")
        name = (m.base_label + (f" d={c['input_depth']}" if c.get("input_depth") else "")
                + _mark(m, bad, baseline))
        series.setdefault(name, []).append((float(c["request_rate"]), g or 0.0))
    top = max(p[0] for pts in series.values() for p in pts)
    ax.plot([0, top], [0, top], color="grey", lw=1, ls=":", label="offered rate (nominal)")
    for j, (name, pts) in enumerate(sorted(series.items())):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                color=_colour(j, name))
    targets = {json.dumps(json.loads(m.context).get("goodput_targets"), sort_keys=True) for m in rated}
    what = ("goodput req/s (meeting every target)" if targets != {"null"} else "completed req/s")
    ax.set_xlabel("offered request rate (req/s, Poisson arrivals)")
    ax.set_ylabel(what)
    ax.set_title("Goodput against request rate")
    _legend(ax)
    _save(fig, plt, out / "goodput_vs_rate.png")
    return True


def check_report_dir(out: Path, store_dir: Path) -> None:
    """UsageError unless ``out`` may hold the report: new, empty, or an earlier report.

    The report may live inside the store (the default, DIR/report) but never be the store itself or
    hold it. A directory holding only report files is an earlier report (written before reports were
    marked) and counts as ours.
    """
    from sparkllm.outdir import OutputRefused, check_output_dir, marker_tool, probe_writable

    try:
        probe_writable(out, "--out")  # before any work: the report is built beside it and swapped in
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
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
    checks = bench_analysis.output_checks(stats, baseline, pair_runs)
    if checks:
        conn = open_store(store_dir)
        try:
            record_output_checks(conn, checks)
        finally:
            conn.close()
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
