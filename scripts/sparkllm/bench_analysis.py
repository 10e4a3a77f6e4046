"""bench: what the report concludes from the rows (standard library; controller side).

- **Outputs against their own noise floor.** Greedy speculative decoding should return the baseline's
  text. Each row's outputs (per prompt, its first answered repeat) are compared with those of the
  baseline run it is paired with: the share of identical outputs and the median share of the agreeing
  prefix (common leading characters / the longer text). The floor is the same comparison between two
  baseline runs of the same context (batch-dependent numerics make bit-equality not guaranteed). A row
  below the floor by more than its margin on either figure is marked "outputs differ from baseline"; the
  margin is ``DIFFER_MARGIN`` of the floor, at least ``DIFFER_MARGIN_MIN`` (0.25 at a floor of 1.0; 0.1 at
  a floor of 0.25, where an absolute 0.25 would let a method that matches no prompt at all pass);
  with no second baseline run the floor is taken as 1.0 (identical) and the report says so. Runs sampled
  with temperature > 0 are not compared.
- **The recommendation.** Among rows of valid runs whose outputs do not differ: the best single-stream
  row (concurrency 1, the smallest input depth measured) by median decode tok/s, and the best row at each
  concurrency level (by per-stream median decode tok/s, which at one level orders rows as their aggregate
  does), each with the 95 % interval of its run medians and of its speedup. ``best_row`` is the rule the
  sweep's ``--leave-best`` uses. Rows of request-rate runs (open loop, no concurrency level) never take
  part in it; at each offered rate ``best_rate_row`` picks the highest goodput (requests/s meeting every
  target; without targets the completed rate), then the highest median decode tok/s
  (``--optimise-rate``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from sparkllm.bench_common import fmt
from sparkllm.bench_depth import FILLER_SHA256

DIFFER_MARGIN = 0.25
DIFFER_MARGIN_MIN = 0.1
OUTPUTS_DIFFER = "outputs differ from baseline"


def below_floor(value: float, floor: float) -> bool:
    """True when ``value`` is below ``floor`` by more than the margin (relative, with a minimum)."""
    return value < floor - max(DIFFER_MARGIN_MIN, DIFFER_MARGIN * floor)


def ctx(m: Any) -> dict[str, Any]:
    return json.loads(m.context) if m.context else {}


def outputs(doc: dict[str, Any]) -> dict[str, str]:
    """prompt id -> output text of its first answered repeat (requests stored before schema 2: none)."""
    out: dict[str, tuple[int, str]] = {}
    for r in doc.get("requests") or []:
        text = r.get("output_text")
        if r.get("ok") and text is not None:
            rep = int(r.get("repeat") or 0)
            if r["prompt_id"] not in out or rep < out[r["prompt_id"]][0]:
                out[r["prompt_id"]] = (rep, text)
    return {k: v for k, (_, v) in out.items()}


def prefix_share(a: str, b: str) -> float:
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    i = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        i += 1
    return i / n


def compare(a: dict[str, str], b: dict[str, str]) -> dict[str, Any] | None:
    keys = sorted(set(a) & set(b))
    if not keys:
        return None
    return {"compared": len(keys), "identical_share": sum(a[k] == b[k] for k in keys) / len(keys),
            "median_prefix_share": statistics.median(prefix_share(a[k], b[k]) for k in keys)}


def _greedy(m: Any) -> bool:
    t = ctx(m).get("temperature")
    return t is None or float(t) == 0.0


def output_checks(stats: Sequence[Any], baseline: str, pair_runs: Any) -> list[dict[str, Any]]:
    """Fill each row's ``outputs`` (its check) and ``differs``; return one stored check per method run."""
    rows = {m.label: m for m in stats}
    floors: dict[str, dict[str, Any] | None] = {}
    for m in stats:
        if m.base_label == baseline and len(m.runs) >= 2:
            pairs = [compare(outputs(a.doc), outputs(b.doc))
                     for a, b in zip(m.runs, m.runs[1:], strict=False)]
            pairs = [p for p in pairs if p]
            if pairs:
                floors[m.label] = {k: statistics.fmean(p[k] for p in pairs)
                                   for k in ("identical_share", "median_prefix_share")}
    checks: list[dict[str, Any]] = []
    for m in stats:
        m.outputs, m.differs = None, False
        base = rows.get(m.baseline_row) if m.baseline_row else None
        if m.base_label == baseline or base is None or not _greedy(m):
            continue
        per_run = []
        for run, b in pair_runs(m.runs, base.runs):
            c = compare(outputs(run.doc), outputs(b.doc))
            if c:
                per_run.append((run, b, c))
        if not per_run:
            continue
        floor = floors.get(base.label)
        f_id = floor["identical_share"] if floor else 1.0
        f_pre = floor["median_prefix_share"] if floor else 1.0
        ident = statistics.fmean(c["identical_share"] for *_, c in per_run)
        pre = statistics.fmean(c["median_prefix_share"] for *_, c in per_run)
        differs = below_floor(ident, f_id) or below_floor(pre, f_pre)
        m.outputs = {"compared": sum(c["compared"] for *_, c in per_run), "identical_share": ident,
                     "median_prefix_share": pre, "floor_identical_share": f_id if floor else None,
                     "floor_median_prefix_share": f_pre if floor else None, "differs": differs}
        m.differs = differs
        checks += [{"run_id": run.run_id, "baseline_run_id": b.run_id, **c,
                    "floor_identical_share": m.outputs["floor_identical_share"],
                    "floor_median_prefix_share": m.outputs["floor_median_prefix_share"], "differs": differs}
                   for run, b, c in per_run]
    return checks


def _config_key(m: Any) -> tuple[str, str | None]:
    """The configuration a row measures, whatever its load point (concurrency, rate, depth)."""
    return (m.base_label, getattr(m, "config_hash", None))


def _differing(stats: Sequence[Any]) -> set[tuple[str, str | None]]:
    """Configurations whose outputs differ from the baseline's at any load point."""
    return {_config_key(m) for m in stats if getattr(m, "differs", False)}


def eligible(stats: Sequence[Any]) -> list[Any]:
    """Rows that may be recommended: a configuration whose outputs differ from the baseline's at any
    load point is out at every load point (batch-dependent garbling shows under load first, and the
    configuration left serving would meet that load)."""
    bad = _differing(stats)
    return [m for m in stats if _config_key(m) not in bad and m.decode["median"] is not None]


def is_rate(m: Any) -> bool:
    return ctx(m).get("request_rate") is not None


def _smallest_depth(at: list[Any]) -> list[Any]:
    depth = min(ctx(m).get("input_depth") or 0 for m in at)
    return [m for m in at if (ctx(m).get("input_depth") or 0) == depth]


def best_rate_row(stats: Sequence[Any], rate: float) -> Any | None:
    """The row to recommend at an offered request rate: eligible rows of that rate, the smallest depth,
    the highest goodput req/s (completed req/s without targets), then the highest median decode tok/s."""
    at = [m for m in eligible(stats) if is_rate(m) and float(ctx(m)["request_rate"]) == float(rate)]
    if not at:
        return None

    def key(m: Any) -> tuple[float, float]:
        r = m.rate or {}
        g = r.get("goodput_req_s") if r.get("goodput_req_s") is not None else r.get("completed_rate_req_s")
        return (g or 0.0, m.decode["median"] or 0.0)

    return max(_smallest_depth(at), key=key)


def best_row(stats: Sequence[Any], concurrency: int = 1) -> Any | None:
    """The row to recommend (and leave serving) at a concurrency level: valid runs only (the rows hold
    nothing else), outputs not differing, closed-loop rows (not request-rate ones), the smallest input
    depth measured at that level, the highest median per-stream decode tok/s."""
    at = [m for m in eligible(stats) if not is_rate(m) and (ctx(m).get("concurrency") or 1) == concurrency]
    if not at:
        return None
    return max(_smallest_depth(at), key=lambda m: m.decode["median"])


def _interval(m: Any) -> str:
    rm, sp = m.run_medians, m.speedup
    run_ci = (f"run medians {fmt(rm['ci95_low'])}-{fmt(rm['ci95_high'])}" if rm.get("ci95_low") is not None
              else "1 run: no interval")
    speed = ""
    if sp.get("gmean"):
        speed = f"; {sp['gmean']:.2f}x baseline"
        if sp.get("ci95_low"):
            speed += f" [{sp['ci95_low']:.2f}-{sp['ci95_high']:.2f}]"
    return run_ci + speed


def recommendation_lines(stats: Sequence[Any]) -> list[str]:
    lines = ["## Recommendation", ""]
    levels = sorted({ctx(m).get("concurrency") or 1 for m in stats if not is_rate(m)})
    bad = _differing(stats)
    excluded = sorted({m.base_label for m in stats if _config_key(m) in bad})
    if not eligible(stats):
        lines.append("No configuration can be recommended: no valid run whose outputs match the baseline.")
    for c in levels:
        m = best_row(stats, c)
        what = "Single stream" if c == 1 else f"{c} concurrent streams"
        if m is None:
            lines.append(f"- **{what}**: none eligible.")
            continue
        agg = fmt(m.aggregate_tok_s)
        lines.append(f"- **{what}**: `{m.label}`, {fmt(m.decode['median'])} tok/s per stream "
                     f"({_interval(m)}), {agg} tok/s aggregate.")
    for rate in sorted({float(ctx(m)["request_rate"]) for m in stats if is_rate(m)}):
        m = best_rate_row(stats, rate)
        what = f"{rate:g} requests/s offered (Poisson arrivals)"
        if m is None:
            lines.append(f"- **{what}**: none eligible.")
            continue
        lines.append(f"- **{what}**: `{m.label}`, {_goodput_words(m)}, "
                     f"{fmt(m.decode['median'])} tok/s per stream.")
    if excluded:
        lines.append(f"- Not recommended whatever their speed ({OUTPUTS_DIFFER}): "
                     + ", ".join(f"`{x}`" for x in excluded) + ".")
    lines.append("- Invalid runs are never counted (listed at the end).")
    return lines


def _targets(t: dict[str, float] | None) -> str:
    return ", ".join(f"{k} <= {v:g} ms" for k, v in (t or {}).items()) or "none"


def _goodput_words(m: Any) -> str:
    r = m.rate or {}
    if r.get("goodput_req_s") is None:
        return f"{fmt(r.get('completed_rate_req_s'))} requests/s completed (no goodput targets)"
    return (f"goodput {fmt(r['goodput_req_s'])} requests/s ({fmt(100 * (r.get('goodput_share') or 0), 0)} % "
            f"meeting {_targets(ctx(m).get('goodput_targets'))})")


def rate_table(stats: Sequence[Any], baseline: str) -> list[str]:
    """Request-rate rows: offered and completed rate, goodput share and rate, latency tails."""
    rated = [m for m in stats if is_rate(m)]
    if not rated:
        return []
    rows = {m.label: m for m in stats}
    lines = ["", "## Request rate (open loop: Poisson arrivals; each rate is its own context, compared with "
             "the baseline at that rate; goodput = requests meeting every target)", "",
             "| row | method | K | offered req/s (schedule's own) | completed req/s | requests | targets "
             "| goodput share "
             "| goodput req/s | goodput vs baseline | TTFT p50 / p99 s | TPOT p50 / p99 ms | outputs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in rated:
        r, c = m.rate or {}, ctx(m)
        base = rows.get(m.baseline_row) if m.baseline_row else None
        b = (base.rate or {}).get("goodput_req_s") if base is not None else None
        g = r.get("goodput_req_s")
        vs = ("1 (reference)" if m.base_label == baseline
              else f"{g / b:.2f}x" if g is not None and b else "-")
        share = r.get("goodput_share")
        lines.append(f"| {m.label} | {m.method} | {fmt(m.k)} | {c['request_rate']:g} "
                     f"({fmt(r.get('offered_rate_req_s'))}) "
                     f"| {fmt(r.get('completed_rate_req_s'))} | {r.get('requests')} "
                     f"| {_targets(c.get('goodput_targets'))} "
                     f"| {fmt(100 * share, 0) + ' %' if share is not None else '-'} | {fmt(g)} | {vs} "
                     f"| {fmt(m.ttft.get('median'), 3)} / {fmt(m.ttft.get('p99'), 3)} "
                     f"| {fmt(m.tpot.get('median'))} / {fmt(m.tpot.get('p99'))} "
                     f"| {_outputs_cell(m, baseline)} |")
    return lines


def _filler(sha: str | None) -> str:
    """The depth filler of a row: the generated one, or the owner's text by the start of its sha256."""
    if not sha or sha == FILLER_SHA256:
        return "generated"
    return f"own text {sha[:12]}"


def _p(d: dict[str, Any] | None, nd: int = 2) -> str:
    d = d or {}
    return f"{fmt(d.get('median'), nd)} / {fmt(d.get('p95'), nd)} / {fmt(d.get('p99'), nd)}"


def tables(stats: Sequence[Any], baseline: str) -> list[str]:
    """Load, latency, depth, outputs, per-category acceptance and telemetry tables."""
    closed = [m for m in stats if not is_rate(m)]
    lines = ["", "## Load (each concurrency level is its own context: speedup vs the baseline at that level)",
             "", "| row | method | K | concurrency | input depth | per-stream decode tok/s median "
             "| aggregate output tok/s | speedup vs baseline [95% CI] | outputs |",
             "|---|---|---|---|---|---|---|---|---|"] if closed else []
    for m in closed:
        c, sp = ctx(m), m.speedup
        speed = "1 (reference)" if m.base_label == baseline else ("-" if sp["gmean"] is None else (
            f"{sp['gmean']:.3f}x"
            + (f" [{sp['ci95_low']:.3f}-{sp['ci95_high']:.3f}]" if sp["ci95_low"] else "")))
        lines.append(f"| {m.label} | {m.method} | {fmt(m.k)} | {c.get('concurrency') or 1} "
                     f"| {c.get('input_depth') or '-'} | {fmt(m.decode['median'])} "
                     f"| {fmt(m.aggregate_tok_s)} "
                     f"| {speed} | {_outputs_cell(m, baseline)} |")
    lines += rate_table(stats, baseline)
    lines += ["", "## Latency (p50 / p95 / p99 over the requests of the row; ITL: mean of the runs' "
              "inter-chunk percentiles)", "", "| row | TTFT s | TPOT ms | ITL ms |", "|---|---|---|---|"]
    lines += [f"| {m.label} | {_p(m.ttft, 3)} | {_p(m.tpot)} | {_p(m.itl)} |" for m in stats]
    deep = [m for m in stats if ctx(m).get("input_depth")]
    if deep:
        lines += ["", "## Context depth (prompt tokens as the server counted them)", "",
                  "| row | target depth | filler | prompt tokens median | TTFT median s "
                  "| prefill tok/s median | decode tok/s median | acceptance rate |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {m.label} | {ctx(m)['input_depth']} | {_filler(ctx(m).get('filler'))} "
                  f"| {fmt(m.prompt_tokens, 0)} "
                  f"| {fmt(m.ttft['median'], 3)} "
                  f"| {fmt(m.prefill_tok_s, 0)} | {fmt(m.decode['median'])} | {fmt(m.acc_rate, 3)} |"
                  for m in deep]
    checked = [m for m in stats if m.outputs]
    if checked:
        lines += ["", f"## Outputs vs baseline (greedy; floor = baseline vs a second baseline run; marked "
                  f"when more than {DIFFER_MARGIN:.2f} below the floor)", "",
                  "| row | prompts compared | identical | median agreeing prefix | floor identical "
                  "| floor prefix | verdict |", "|---|---|---|---|---|---|---|"]
        for m in checked:
            o = m.outputs
            lines.append(f"| {m.label} | {o['compared']} | {o['identical_share']:.2f} "
                         f"| {o['median_prefix_share']:.2f} "
                         f"| {fmt(o['floor_identical_share'])} | {fmt(o['floor_median_prefix_share'])} "
                         f"| {OUTPUTS_DIFFER.upper() if o['differs'] else 'same as baseline'} |")
        if any(o.outputs["floor_identical_share"] is None for o in checked):
            lines.append("\nA floor of `-`: only one baseline run in that context, so the floor is taken "
                         "as identical outputs (1.0).")
    cats = sorted({c for m in stats for c in m.cat_acceptance})
    if cats:
        lines += ["", "## Acceptance rate per category (server counters, concurrency-1 runs)", "",
                  "| row | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
        lines += [f"| {m.label} | " + " | ".join(fmt(m.cat_acceptance.get(c), 3) for c in cats) + " |"
                  for m in stats if m.cat_acceptance]
    lines += ["", "## Energy and clocks (nvidia-smi during the measured phase)", "",
              "| row | J per output token | mean power W | max temperature C | SM clock min-max MHz "
              "| warnings |", "|---|---|---|---|---|---|"]
    for m in stats:
        t = m.telemetry
        clocks = f"{fmt(t.get('sm_clock_mhz_min'), 0)}-{fmt(t.get('sm_clock_mhz_max'), 0)}"
        warn = "; ".join(t.get("warnings") or []) or (t.get("note") or "-")
        lines.append(f"| {m.label} | {fmt(t.get('j_per_output_token'), 3)} | {fmt(t.get('power_w_mean'), 1)} "
                     f"| {fmt(t.get('temp_c_max'), 0)} | {clocks} | {warn} |")
    return lines


def _outputs_cell(m: Any, baseline: str) -> str:
    if m.base_label == baseline:
        return "reference"
    if not m.outputs:
        return "not compared"
    return f"**{OUTPUTS_DIFFER}**" if m.outputs["differs"] else "same as baseline"
