#!/usr/bin/env python3
"""`make tune` (controller): sweep method x K x INT8 LM head with the records profile, leave the fastest
lossless configuration serving, and print it beside the public records and the ceiling.

    tune.py [--methods baseline,mtp,dflash] [--quick] [--heads int8,bf16] [--repeats N]
            [--inventory INV] [--results DIR] [--start-s S] [--extra-vars JSON] [--dry-run] [--quiet]

A thin layer over scripts/sweep.py (its grid, interleaving, resume, report and --leave-best):

- Grid: baseline; mtp K 1, 2, 3 (albond's record is MTP-2); dflash K 5, 8, 12 (sweep.DEFAULT_K); each
  with the INT8 LM head on and off (``vllm_lm_head_int8``), 14 configurations. baseline is always in
  it, under the label ``baseline`` for both heads, since a method's outputs are checked against the
  baseline served with the same head (bench_analysis) and only checked methods may be left serving.
  ``--quick``: the head's default (INT8) only, mtp K 2 and dflash K 8 (3 configurations, about half
  an hour by the estimate below). ``--methods`` narrows the methods; a method this deploy cannot
  serve is left out, named.
- Every cell runs the bench with ``bench_profile: records`` (the public records' protocol).
- Before it starts it prints its estimate for the cells not yet recorded: per cell, a server start
  (``--start-s``, default START_S) plus the records profile's passes (bench_repeats + the discarded
  first) x the prompt set's token limits (scripts/prompts/records.jsonl) / an expected tok/s per
  method (EXPECTED_TOK_S, public figures). It is an upper bound on generation (every answer at its
  limit, as thinking-on answers mostly are) and says what it assumed.
- Resumable: an interrupted tune run again skips the cells the results store holds (sweep's resume).

Exit codes: 0 every cell ran and the best checked configuration is serving; 1 a cell failed, no
configuration could be checked against a baseline, or leaving the best serving failed; 2 usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sweep
from sparkllm.cli import UsageError, doc_parser, run_main

METHODS = ("baseline", "mtp", "dflash")
MTP_K = (1, 2, 3)
QUICK_K = {"mtp": [2], "dflash": [8]}
HEADS = ("int8", "bf16")
PROFILE = "records"
RECORDS_PROMPTS = sweep.REPO_ROOT / "scripts" / "prompts" / "records.jsonl"
# Seconds from a method switch to a measured server, assumed: ~180 s to ready with fastsafetensors (the
# README's public figure, Entrpi's GB10 log; not measured by us) + 60 s for the serve and bench plays.
START_S = 240.0
# Expected end-to-end tok/s on the records' harness, per method (public figures, not ours): baseline 28.2
# (Entrpi, no speculation, INT4, vLLM 0.23); mtp 41 (issue 44's estimate for our default, 0.8 x albond's
# 51.58); dflash 53.7 (Entrpi, DFlash K=12 without the dense patches, albond's harness).
EXPECTED_TOK_S = {"baseline": 28.2, "mtp": 41.0, "dflash": 53.7}
FALLBACK_TOK_S = 28.2  # a method without a figure: as slow as baseline


def build_grid(methods: Sequence[str], heads: Sequence[str], quick: bool, extra: dict[str, Any],
               known: Sequence[str]) -> list[sweep.CellConfig]:
    """The tune's configurations: every method and K, for every head (baseline first, always)."""
    methods = ["baseline", *[m for m in methods if m != "baseline"]]
    ks = dict(QUICK_K) if quick else {**sweep.DEFAULT_K}
    mtp_k = ks.pop("mtp", list(MTP_K))
    out: list[sweep.CellConfig] = []
    for head in heads:
        ev = {**extra, "bench_profile": PROFILE, "vllm_lm_head_int8": head == "int8"}
        for c in sweep.expand_grid(methods, mtp_k, ev, known, ks):
            tag = "" if head == "int8" or c.method == "baseline" else f"{head}head"
            out.append(dataclasses.replace(c, tag=tag))
    return out


def tokens_per_pass(path: Path = RECORDS_PROMPTS) -> int:
    """The sum of the records prompt set's per-prompt token limits (one pass's most generated tokens)."""
    total = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            total += int(json.loads(line)["max_tokens"])
    return total


@dataclasses.dataclass(frozen=True)
class Estimate:
    cells: int
    seconds: float
    passes: int
    tokens_per_pass: int
    start_s: float

    def lines(self) -> list[str]:
        h, m = divmod(round(self.seconds / 60), 60)
        figures = ", ".join(f"{k} {v:g}" for k, v in EXPECTED_TOK_S.items())
        return [f"estimate: {self.cells} cells to run, about {h} h {m:02d} min",
                f"  assumed per cell: {self.start_s:g} s server start and plays + {self.passes} passes x "
                f"{self.tokens_per_pass} tokens (the records prompts' limits; the first pass is discarded) "
                f"/ expected tok/s ({figures}; public figures, not measured here)"]


def estimate(cells: Sequence[sweep.Cell], passes: int, per_pass: int, start_s: float = START_S) -> Estimate:
    secs = sum(start_s + passes * per_pass / EXPECTED_TOK_S.get(c.config.method, FALLBACK_TOK_S)
               for c in cells)
    return Estimate(len(cells), secs, passes, per_pass, start_s)


def _head(c: sweep.CellConfig) -> str:
    return "INT8" if json.loads(c.extra_vars_json).get("vllm_lm_head_int8") else "BF16"


def _list(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if not items or bad:
        raise UsageError(f"{flag} {text!r}: choose from {', '.join(allowed)}, e.g. {flag} {allowed[0]}")
    return items


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("tune.py", __doc__)
    p.add_argument("--methods", default=",".join(METHODS),
                   help="methods to tune, baseline always added (default %(default)s)")
    p.add_argument("--heads", default=",".join(HEADS),
                   help="LM heads: int8, bf16 or both (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="INT8 head only, mtp K 2, dflash K 8 (default: the full grid)")
    p.add_argument("--repeats", type=int, default=1, help="repetitions of every configuration (default 1; "
                   "each run already measures bench_repeats passes)")
    p.add_argument("--inventory", default=str(sweep.REPO_ROOT / "inventory" / "hosts.yml"),
                   help="Ansible inventory (default %(default)s)")
    p.add_argument("--results", default=str(sweep.REPO_ROOT / "results"),
                   help="results directory, the sweep's (default %(default)s)")
    p.add_argument("--start-s", type=float, default=START_S,
                   help="assumed seconds per server start and plays, for the estimate (default %(default)s)")
    p.add_argument("--extra-vars", default="{}", help="JSON object passed to every run (default {})")
    p.add_argument("--dry-run", action="store_true",
                   help="print the grid and the estimate, run nothing (default: run)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (default: a bar on a terminal)")
    return p


def main(argv: list[str] | None = None, runner: sweep.Runner | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run_main("tune.py", lambda: _main(a, runner))


def _main(a: argparse.Namespace, runner: sweep.Runner | None) -> int:
    extra = sweep.extra_vars(a.extra_vars)
    if a.repeats < 1 or a.start_s < 0:
        raise UsageError("--repeats must be >= 1 and --start-s >= 0")
    if a.inventory and "," not in a.inventory and not Path(a.inventory).exists():
        raise UsageError(f"--inventory {a.inventory}: no such file; pass your inventory")
    heads = ["int8"] if a.quick else _list(a.heads, HEADS, "--heads")
    settings = {**sweep.load_settings(), **extra}
    known = list(settings.get("spark_method_catalogue") or {})
    wanted = _list(a.methods, [m for m in known if m in METHODS], "--methods")
    problems = sweep.method_problems(settings)
    for m in [m for m in wanted if m in problems]:
        print(f"{m}: left out: {problems[m]}", file=sys.stderr)
    methods = [m for m in wanted if m not in problems]
    if "baseline" in problems:
        raise UsageError(f"baseline cannot be served ({problems['baseline']}); the tune checks every method "
                         "against it")
    bench = {**{k: v for k, v in sweep.bench_defaults().items() if k == "bench_repeats"}, **settings}
    passes = int(bench.get("bench_repeats") or 1) + 1  # the records profile discards its first pass
    configs = build_grid(methods, heads, a.quick, extra, known)
    sw = sweep.Sweep(configs, a.repeats, Path(a.results).resolve(), inventory=a.inventory,
                     runner=runner or sweep.ansible_runner_run, quiet=a.quiet,
                     # the records profile is single stream: the role's own load point, whatever was given
                     load=sweep.load_points({k: v for k, v in settings.items()
                                             if k not in sweep.LOAD_POINT_VARS}))
    done = sweep.recorded_cells(sw.results_dir) if sw.results_dir.is_dir() else set()
    todo = [c for c in sw.cells() if sw.missing(c, done)]
    print("grid: " + ", ".join(f"{c.label} [{_head(c)}]" for c in configs))
    for line in estimate(todo, passes, tokens_per_pass(), a.start_s).lines():
        print(line, flush=True)
    if a.dry_run:
        return 0
    res = sw.run()
    print(f"ran {len(res.ran)}, skipped {len(res.skipped)} (already recorded), failed {len(res.failed)}")
    for cell, why in res.failed:
        print(f"  FAILED {cell.config.label} rep {cell.repetition}: {why}")
    if res.report:
        print(f"report: {res.report}")
    if res.best is None or not res.best_checked:
        print("tune.py: error: no configuration's outputs matched a baseline run with the same head, so none "
              "is left serving; see the report's verdict", file=sys.stderr)
        return 1
    print(f"fastest lossless configuration: {res.best.label} (spec_method={res.best.method}, "
          f"spec_num_speculative_tokens={res.best.k}, {_head(res.best)} LM head)")
    for line in summary(sw.results_dir, res.best.config_hash):
        print(line)
    out = sw.leave_best(res.best)
    print(f"left {res.best.label} serving: {out.status}" + (f" ({out.failure})" if out.failure else ""))
    return 0 if out.ok and not res.failed else 1


def summary(results_dir: Path, config_hash: str) -> list[str]:
    """The report's summary lines of one configuration: its records figure beside the public records,
    and its fraction of the ceiling."""
    from sparkllm.bench import ceiling as bench_ceiling
    from sparkllm.bench import records as bench_records
    from sparkllm.bench import report as bench_report

    stats = [s for s in bench_report.method_table(bench_report.load_runs(results_dir), "baseline")
             if s.config_hash == config_hash]
    return [*bench_records.summary_lines(stats), *bench_ceiling.summary_lines(stats)]


if __name__ == "__main__":
    sys.exit(main())
