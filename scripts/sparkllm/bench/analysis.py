"""bench: what the report concludes from the rows (standard library; controller side).

- **Outputs against their own noise floor** (docs/benchmarks.md). Greedy speculative decoding should
  return the baseline's text. Per prompt, a row's outputs (its first answered repeat of each run) are
  compared with those of the baseline runs they are paired with: a prompt *differs* when its text differs
  in any pair, and the first differing character is its divergence position. The floor is the same count
  between repeat runs of that baseline row (batch-dependent numerics make bit-equality not guaranteed);
  with one baseline run there is none and the floor is taken as 1.00 (the report says so). The verdict
  "outputs differ from baseline" is a one-sided exact binomial test of the row's differing count against
  the floor's mismatch share (at least ``VERDICT_ALLOWANCE``), at ``VERDICT_ALPHA``: a method that differs
  no more often than the floor is flagged with probability at most alpha; ``bench_stats.miss_rate`` and
  ``prompts_needed`` give the chance of missing a given error share. The baseline row is the one of the
  same context (load, sampling, model, checkpoint, prompts); without one at that load point, a baseline
  row of the same checkpoint, prompt set, sampling and host at another load point; always one served with
  the same LM head (the run meta's ``lm_head_int8``, absent = BF16), as INT8 logits differ. Rows with none are
  "outputs not checked", beside the recommendation too, with the command that records a baseline. Runs
  sampled with temperature > 0 are not compared.
- **The recommendation.** Among rows of valid runs whose outputs do not differ: the best single-stream
  row (concurrency 1, the smallest input depth measured) by median decode tok/s, and the best row at each
  concurrency level (by per-stream median decode tok/s, which at one level orders rows as their aggregate
  does), each with the 95 % interval of its run medians and of its speedup. ``best_row`` is the rule the
  sweep's ``--leave-best`` uses (with ``checked_only``: rows never compared are left out). Rows of
  request-rate runs (open loop, no concurrency level) never take part in it; at each offered rate
  ``best_rate_row`` picks the highest goodput (requests/s meeting every target; without targets the
  completed rate), then the highest median decode tok/s (``--optimise-rate``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from sparkllm.bench import ceiling as bench_ceiling
from sparkllm.bench import records as bench_records
from sparkllm.bench.common import fmt
from sparkllm.bench.depth import FILLER_SHA256
from sparkllm.bench.stats import (
    VERDICT_ALLOWANCE,
    VERDICT_ALPHA,
    binom_tail,
    critical_count,
    miss_rate,
    null_share,
    prompts_needed,
)

OUTPUTS_DIFFER = "outputs differ from baseline"
NOT_CHECKED = "outputs not checked"
# what records the outputs a method is checked against (a single-method deploy labels its runs mtp-k2 ...)
FIX_BASELINE = ("`make deploy SPEC_METHOD=baseline` on that Spark with the same checkpoint, prompt set and "
                "vllm_lm_head_int8 (or `scripts/sweep.py --methods baseline,...`), then "
                "`bench.py report DIR`")
# the load is not part of what must match for outputs: greedy text does not depend on it (the floor and
# the check at each level catch batch-dependent numerics)
_LOAD_KEYS = ("concurrency", "request_rate", "goodput_targets")


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


def common_prefix(a: str, b: str) -> int:
    i = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        i += 1
    return i


def prefix_share(a: str, b: str) -> float:
    n = max(len(a), len(b))
    return 1.0 if n == 0 else common_prefix(a, b) / n


def prompt_diffs(pairs: Sequence[tuple[dict[str, str], dict[str, str]]]) -> dict[str, dict[str, Any]]:
    """prompt id -> {same: identical in every pair, prefix: the smallest agreeing-prefix share,
    diverge_at: the first differing character (None when the same)} over pairs of outputs."""
    out: dict[str, dict[str, Any]] = {}
    for a, b in pairs:
        for k in sorted(set(a) & set(b)):
            same, pre = a[k] == b[k], prefix_share(a[k], b[k])
            pos = None if same else common_prefix(a[k], b[k])
            d = out.setdefault(k, {"same": True, "prefix": 1.0, "diverge_at": None})
            d["same"] = d["same"] and same
            d["prefix"] = min(d["prefix"], pre)
            if pos is not None:
                d["diverge_at"] = pos if d["diverge_at"] is None else min(d["diverge_at"], pos)
    return out


def verdict(method: dict[str, dict[str, Any]], floor: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """The check of one row: counts, the floor's, the exact test's p-value and the decision."""
    n = len(method)
    x = sum(not d["same"] for d in method.values())
    f_n = len(floor) if floor else 0
    f_x = sum(not d["same"] for d in floor.values()) if floor else 0
    f_share = (1 - f_x / f_n) if f_n else None
    p0 = null_share(f_x / f_n if f_n else None)
    p_value = binom_tail(n, p0, x)
    pos = sorted(d["diverge_at"] for d in method.values() if d["diverge_at"] is not None)
    return {"compared": n, "differing": x, "identical_share": (n - x) / n,
            "median_prefix_share": statistics.median(d["prefix"] for d in method.values()),
            "floor_compared": f_n or None, "floor_identical_share": f_share,
            "floor_median_prefix_share": (statistics.median(d["prefix"] for d in floor.values())
                                          if f_n else None),
            "null_mismatch_share": p0, "critical": critical_count(n, p0), "p_value": p_value,
            "first_divergence_min": pos[0] if pos else None,
            "first_divergence_median": statistics.median(pos) if pos else None,
            "differs": p_value <= VERDICT_ALPHA}


def compare(a: dict[str, str], b: dict[str, str]) -> dict[str, Any] | None:
    """One pair of runs: prompts compared, identical share, median agreeing prefix (the stored check)."""
    d = prompt_diffs([(a, b)])
    if not d:
        return None
    return {"compared": len(d), "identical_share": sum(x["same"] for x in d.values()) / len(d),
            "median_prefix_share": statistics.median(x["prefix"] for x in d.values())}


def _greedy(m: Any) -> bool:
    t = ctx(m).get("temperature")
    return t is None or float(t) == 0.0


def _host(m: Any) -> str | None:
    return next((str(h) for r in m.runs if (h := r.doc.get("meta", {}).get("host"))), None)


def lm_head_int8(m: Any) -> bool:
    """Whether the row was served with the INT8 LM head (the run meta's ``lm_head_int8``, the bench role's
    record of vllm_lm_head_int8). A run without the key is BF16: stores from before the key existed were
    served with the BF16 head, then the default."""
    for r in m.runs:
        v = r.doc.get("meta", {}).get("lm_head_int8")
        if v is True or (isinstance(v, str) and v.strip().lower() in ("true", "1", "yes")):
            return True
    return False


def _outputs_key(m: Any) -> str:
    """What outputs compared across rows must share: the context less the load, plus the host and the LM
    head's dtype (the INT8 head changes logits slightly, so its greedy text is compared only with a baseline
    served with the same head)."""
    c = {k: v for k, v in ctx(m).items() if k not in _LOAD_KEYS}
    return json.dumps({**c, "host": _host(m), "lm_head_int8": lm_head_int8(m)}, sort_keys=True, default=str)


def reference_row(m: Any, stats: Sequence[Any], baseline: str) -> Any | None:
    """The baseline row a row's outputs are checked against: the one of its context (its speedup's),
    else one of the same checkpoint, prompts, sampling and host at another load (most runs, least load)."""
    rows = {r.label: r for r in stats}
    key = _outputs_key(m)
    base = rows.get(m.baseline_row) if m.baseline_row else None
    if base is not None and _outputs_key(base) == key:
        return base
    others = [b for b in stats if b.base_label == baseline and _outputs_key(b) == key]
    if not others:
        return None
    return max(others, key=lambda b: (len(b.runs), -(ctx(b).get("concurrency") or 0)))


def output_checks(stats: Sequence[Any], baseline: str, pair_runs: Any) -> list[dict[str, Any]]:
    """Fill each row's ``outputs`` (its check) and ``differs``; return one stored check per method run."""
    floors: dict[str, dict[str, dict[str, Any]] | None] = {}
    for m in stats:
        if m.base_label == baseline:
            pairs = [(outputs(a.doc), outputs(b.doc)) for a, b in zip(m.runs, m.runs[1:], strict=False)]
            floors[m.label] = prompt_diffs(pairs) or None
    checks: list[dict[str, Any]] = []
    for m in stats:
        m.outputs, m.differs = None, False
        if m.base_label == baseline or not _greedy(m):
            continue
        base = reference_row(m, stats, baseline)
        if base is None:
            continue
        pairs = [(run, b, outputs(run.doc), outputs(b.doc)) for run, b in pair_runs(m.runs, base.runs)]
        diffs = prompt_diffs([(a, b) for *_, a, b in pairs])
        if not diffs:
            continue
        v = verdict(diffs, floors.get(base.label))
        v.update(baseline_row=base.label, baseline_runs=sorted({b.run_id for _, b, *_ in pairs}),
                 baseline_started=min((b.started or "" for _, b, *_ in pairs), default=None) or None,
                 same_context=base.label == m.baseline_row)
        m.outputs, m.differs = v, v["differs"]
        for run, b, a, bo in pairs:
            c = compare(a, bo)
            if c:
                checks.append({"run_id": run.run_id, "baseline_run_id": b.run_id, **c,
                               "floor_identical_share": v["floor_identical_share"],
                               "floor_median_prefix_share": v["floor_median_prefix_share"],
                               "differs": v["differs"]})
    return checks


def checked(m: Any, baseline: str) -> bool:
    """The row is the baseline itself or its outputs were compared with one."""
    return m.base_label == baseline or m.outputs is not None


def verdict_word(m: Any, baseline: str) -> str:
    """One word for the CSV and the charts: reference, same, differs, not checked."""
    if m.base_label == baseline:
        return "reference"
    if m.outputs is None:
        return "not checked"
    return "differs" if m.outputs["differs"] else "same"


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


def best_rate_row(stats: Sequence[Any], rate: float, checked_only: str | None = None) -> Any | None:
    """The row to recommend at an offered request rate: eligible rows of that rate, the smallest depth,
    the highest goodput req/s (completed req/s without targets), then the highest median decode tok/s."""
    at = [m for m in eligible(stats) if is_rate(m) and float(ctx(m)["request_rate"]) == float(rate)
          and (checked_only is None or checked(m, checked_only))]
    if not at:
        return None

    def key(m: Any) -> tuple[float, float]:
        r = m.rate or {}
        g = r.get("goodput_req_s") if r.get("goodput_req_s") is not None else r.get("completed_rate_req_s")
        return (g or 0.0, m.decode["median"] or 0.0)

    return max(_smallest_depth(at), key=key)


def best_row(stats: Sequence[Any], concurrency: int = 1, checked_only: str | None = None) -> Any | None:
    """The row to recommend (and leave serving) at a concurrency level: valid runs only (the rows hold
    nothing else), outputs not differing, closed-loop rows (not request-rate ones), the smallest input
    depth measured at that level, the highest median per-stream decode tok/s. ``checked_only`` (the
    baseline label): rows whose outputs were never compared with that baseline are left out too."""
    at = [m for m in eligible(stats) if not is_rate(m) and (ctx(m).get("concurrency") or 1) == concurrency
          and (checked_only is None or checked(m, checked_only))]
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


def _check_words(m: Any, baseline: str) -> str:
    """What was checked, beside a recommended row."""
    if m.base_label == baseline:
        return "the reference"
    o = m.outputs
    if o is None:
        why = "sampled at temperature > 0" if not _greedy(m) else f"no `{baseline}` run to compare with"
        return f"**{NOT_CHECKED}** ({why})"
    where = "" if o.get("same_context") else " at another load"
    same = o["compared"] - o["differing"]
    return (f"outputs same as `{o['baseline_row']}`{where} on {same}/{o['compared']} prompts"
            f" (p = {o['p_value']:.2g})")


def recommendation_lines(stats: Sequence[Any], baseline: str = "baseline") -> list[str]:
    lines = ["## Recommendation", ""]
    levels = sorted({ctx(m).get("concurrency") or 1 for m in stats if not is_rate(m)})
    bad = _differing(stats)
    excluded = sorted({m.base_label for m in stats if _config_key(m) in bad})
    unchecked = sorted({m.base_label for m in stats if not checked(m, baseline)})
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
                     f"({_interval(m)}), {agg} tok/s aggregate; {_check_words(m, baseline)}.")
    for rate in sorted({float(ctx(m)["request_rate"]) for m in stats if is_rate(m)}):
        m = best_rate_row(stats, rate)
        what = f"{rate:g} requests/s offered (Poisson arrivals)"
        if m is None:
            lines.append(f"- **{what}**: none eligible.")
            continue
        lines.append(f"- **{what}**: `{m.label}`, {_goodput_words(m)}, "
                     f"{fmt(m.decode['median'])} tok/s per stream; {_check_words(m, baseline)}.")
    if excluded:
        lines.append(f"- Not recommended whatever their speed ({OUTPUTS_DIFFER}): "
                     + ", ".join(f"`{x}`" for x in excluded) + ".")
    if unchecked:
        lines.append(f"- {NOT_CHECKED.capitalize()} for " + ", ".join(f"`{x}`" for x in unchecked)
                     + f": no `{baseline}` run of the same checkpoint, prompt set, sampling and LM head in "
                     f"this store, so a method that garbles answers cannot be told from a right one. "
                     f"Record one: {FIX_BASELINE}.")
    lines.append("- Invalid runs are never counted (listed at the end).")
    return lines


def summary_lines(stats: Sequence[Any], baseline: str) -> list[str]:
    """One line per row that is not the baseline: what its outputs were compared with, and the verdict
    (printed by ``bench.py report``; the bench role shows them after a deploy)."""
    out = []
    for m in stats:
        if m.base_label == baseline:
            continue
        o = m.outputs
        if o is None:
            out.append(f"outputs of {m.label}: NOT CHECKED: no {baseline} run of the same checkpoint, prompt "
                       f"set, sampling and LM head in the store; record one: {FIX_BASELINE.replace('`', '')}")
            continue
        verdict_text = OUTPUTS_DIFFER.upper() if o["differs"] else "same as baseline"
        out.append(f"outputs of {m.label}: {verdict_text}: compared with {o['baseline_row']} "
                   f"(runs {', '.join(o['baseline_runs'])}, recorded {o['baseline_started'] or '-'}): "
                   f"{o['differing']} of {o['compared']} prompts differ, floor "
                   f"{fmt(o['floor_identical_share'])}, p = {o['p_value']:.2g}")
    return out + bench_records.summary_lines(stats) + bench_ceiling.summary_lines(stats)


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
    lines += outputs_table(stats)
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
        return NOT_CHECKED
    return f"**{OUTPUTS_DIFFER}**" if m.outputs["differs"] else "same as baseline"


def outputs_table(stats: Sequence[Any]) -> list[str]:
    """Per checked row: the counts, the floor, the exact test and the first divergence; then what the
    test can and cannot see at these prompt counts (docs/benchmarks.md)."""
    checked_rows = [m for m in stats if m.outputs]
    if not checked_rows:
        return []
    lines = ["", f"## Outputs vs baseline (greedy; per prompt; \"differ\" = one-sided exact binomial test of "
             f"the differing count against the floor's mismatch share, at least {VERDICT_ALLOWANCE:.2f}, "
             f"alpha {VERDICT_ALPHA:g}; docs/benchmarks.md)", "",
             "| row | compared with | prompts | differing | identical | median agreeing prefix "
             "| floor identical (prompts) | p-value | flagged from | first divergence (chars, min / median) "
             "| verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in checked_rows:
        o = m.outputs
        floor = (f"{o['floor_identical_share']:.2f} ({o['floor_compared']})" if o["floor_compared"]
                 else "- (one baseline run: taken as 1.00)")
        where = o["baseline_row"] + ("" if o.get("same_context") else " (other load)")
        lines.append(f"| {m.label} | {where} | {o['compared']} | {o['differing']} "
                     f"| {o['identical_share']:.2f} "
                     f"| {o['median_prefix_share']:.2f} | {floor} | {o['p_value']:.2g} "
                     f"| {o['critical']} differing | {fmt(o['first_divergence_min'], 0)} / "
                     f"{fmt(o['first_divergence_median'], 0)} "
                     f"| {OUTPUTS_DIFFER.upper() if o['differs'] else 'same as baseline'} |")
    n = min(m.outputs["compared"] for m in checked_rows)
    need = {e: prompts_needed(e) for e in (0.05, 0.10, 0.25)}
    lines.append(f"\nA method at the floor is flagged with probability at most {VERDICT_ALPHA:g} "
                 f"(false alarm). With {n} prompts and a floor of 1.00, a method wrong on 10 % of them is "
                 f"missed with probability {miss_rate(n, 0.10):.2f}, on 25 % with {miss_rate(n, 0.25):.2f}; "
                 "detecting an error share with 95 % probability needs "
                 + ", ".join(f"{need[e] or '>5000'} prompts for {e:.0%}" for e in need)
                 + " (more at a lower floor).")
    return lines
