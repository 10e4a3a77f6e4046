#!/usr/bin/env python3
"""Method sweep (controller): serve + bench every configuration, interleaved, resumable.

    sweep.py [--methods baseline,ngram,mtp,...] [--mtp-k 1,2,4] [--repeats N]
             [--concurrency 1,2,4] [--request-rate 0.5,1,2 --goodput ttft=2000ms,tpot=100ms]
             [--inventory INV] [--results DIR] [--leave-best [--optimise-rate R]] [--extra-vars JSON]

Methods: by default, the catalogue's methods (group_vars/all/methods.yml) whose requirements are met
by the settings (group_vars/all/*.yml overlaid with --extra-vars): every knob in the method's
``requires`` is set, and its vLLM build is one that ``make deploy`` provides with these settings (the
variants of ``spec_method`` and ``vllm_build_methods``), since the sweep runs only the serve and bench
stages. Each method left out is named with the reason; ``--methods`` lists them explicitly.

Grid: one configuration per method; ``mtp`` expands to one per ``--mtp-k`` value and any method
named with ``--k METHOD=K1,K2`` to one per K (checked against the catalogue: the method must take K
and K must lie in SPEC_TOKENS_RANGE); ``dflash`` sweeps K 5, 8 and 12 unless ``--k dflash=...`` says
otherwise (DEFAULT_K: docs/performance.md "DFlash draft length"); other methods use the catalogue's
default K (``spec_num_speculative_tokens`` null).  Schedule: methods are
interleaved across repetitions (rep 1: every configuration, rep 2: every configuration, ...), so
slow drifts (thermals, page cache) hit every method alike and the report can pair runs by
repetition index.  Each cell drives ``site.yml`` through ansible-runner with tags
``cluster,serve,bench`` (MEASURE_TAGS; the cluster stage ends at once on one Spark, and on several it
gives the Ray units the new method's image and environment)
and extravars ``spec_method``, ``spec_num_speculative_tokens``, ``bench_label``,
``bench_repetition``, ``bench_cell`` (the cell's description, from which the bench role computes its
hash; plus ``bench_results_dir``, the controller results directory, and anything from ``--extra-vars``).

Load points: every cell measures each concurrency level of ``--concurrency`` (closed loop) and each
rate of ``--request-rate`` (open loop, Poisson arrivals, goodput against ``--goodput``), at each depth
of ``--depth`` (they set bench_concurrency, bench_request_rate, bench_goodput and bench_depth; given
in ``--extra-vars`` instead they mean the same). With ``--request-rate`` and no ``--concurrency`` only
rates are measured.

Configuration hash: filter_plugins/spark_bench.py, the bench role's own implementation: sha256 over
the canonical JSON of {method, k, extra_vars without the load-point lists (LOAD_POINT_VARS)}, first 16
hex digits: one served configuration, whatever loads it is measured at.  Resume: a load point of a
cell is done when the store holds a *valid* run with the same configuration hash, repetition,
concurrency level (or request rate) and depth (invalid runs are retried); a cell whose points are
all done is skipped, a cell with some done runs only the missing levels, rates and depths (with
bench_force, since the bench role's own check knows only the hash and repetition).  The end:
``bench.py report`` on the results directory and the best configuration (highest median decode
tok/s over valid runs at ``--optimise-concurrency``, or the highest goodput at ``--optimise-rate``,
leaving out rows whose outputs differ from the baseline's); ``--leave-best`` reruns the serve stage
for it.

A failed cell is reported with the failing task, its host and its message (from ansible-runner's
events); the runner's artifacts (stdout, events) are kept under ``DIR/runner/<label>-rep<N>-<time>/``.
The report is ``DIR/report/report.md`` (``bench.py report``).

Exit codes: 0 every cell ran and recorded a valid run; 1 a cell failed (or --leave-best failed);
2 usage error (unknown method, a method whose requirements are not met, bad --extra-vars, a results
store that is not one). ``--leave-best`` chooses only among methods whose outputs were compared with a
``baseline`` run (``--allow-unchecked`` lifts that); with none it refuses (exit 1) and says why.

The ansible-runner call is injectable (``Sweep(runner=...)``) so tests replace it with a fake.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkllm.bench import analysis as bench_analysis
from sparkllm.bench import cli as bench_cli
from sparkllm.bench import rate as bench_rate
from sparkllm.bench import report as bench_report
from sparkllm.bench import store as bench_store
from sparkllm.cli import UsageError, doc_parser, run_main

REPO_ROOT = Path(__file__).resolve().parent.parent
# the filters are the same code Ansible runs (filter_plugins/: the cell identity, the catalogue's K range)
if str(REPO_ROOT / "filter_plugins") not in sys.path:
    sys.path.append(str(REPO_ROOT / "filter_plugins"))
import spark_bench  # noqa: E402
import spark_methods  # noqa: E402

SETTINGS_DIR = REPO_ROOT / "group_vars" / "all"
BENCH_DEFAULTS = REPO_ROOT / "roles" / "bench" / "defaults" / "main.yml"
RUNNER_DIRNAME = "runner"  # ansible-runner artifacts of every cell, under the results directory
# The stages a cell runs, and the ones that leave the best configuration serving. The cluster stage comes
# with serve: on several Sparks the Ray head and workers run the method's vLLM image with the server's
# environment (its server_env, the INT8 head), so a switch of method must re-render them; on one Spark the
# stage ends at its first task.
MEASURE_TAGS = "cluster,serve,bench"
SERVE_TAGS = "cluster,serve"
# K values swept for a method when --k does not name it (mtp's come from --mtp-k): DFlash's catalogue
# default sits between the published per-position curves, and these three bracket it.
DEFAULT_K = {"dflash": [5, 8, 12]}


# The cell identity, one implementation with the bench role's (filter_plugins/spark_bench.py).
_CELLS = spark_bench
# the bench role's load-point lists: what a cell is measured at, not what is served (not in the hash)
LOAD_POINT_VARS = _CELLS.LOAD_POINT_VARS


def load_settings(settings_dir: Path = SETTINGS_DIR) -> dict[str, Any]:
    """The toolkit's settings and catalogue (every group_vars/all/*.yml, merged in name order)."""
    import yaml  # controller only (comes with ansible-core)

    out: dict[str, Any] = {}
    for f in sorted(settings_dir.glob("*.yml")):
        doc = yaml.safe_load(f.read_text(encoding="utf-8"))
        if isinstance(doc, dict):
            out.update(doc)
    return out


def _is_set(v: Any) -> bool:
    return v is not None and v != "" and v != [] and v != {}


def method_problems(settings: dict[str, Any]) -> dict[str, str]:
    """method -> why the sweep cannot serve it with these settings (absent when it can)."""
    catalogue: dict[str, Any] = settings.get("spark_method_catalogue") or {}
    deployed = [settings.get("spec_method"), *(settings.get("vllm_build_methods") or [])]
    built = {catalogue[m]["vllm_variant"] for m in deployed if m in catalogue}
    problems: dict[str, str] = {}
    for name, entry in catalogue.items():
        missing = [k for k in entry.get("requires") or [] if not _is_set(settings.get(k))]
        if missing:
            problems[name] = (f"needs {', '.join(missing)}: pass --extra-vars "
                              f"'{{\"{missing[0]}\": ...}}'")
        elif entry.get("vllm_variant") not in built:
            problems[name] = (f"its vLLM build {entry.get('vllm_variant')} is not provided by `make deploy` "
                              f"with these settings (spec_method={settings.get('spec_method')}): "
                              f"add {name} to vllm_build_methods and deploy, then pass --methods with it")
    return problems


@dataclass(frozen=True)
class CellConfig:
    """One server configuration of the grid."""

    method: str
    k: int | None = None
    extra_vars_json: str = "{}"
    tag: str = ""  # appended to the label (e.g. "bf16head"): not in the hash, which the extra vars make

    @property
    def label(self) -> str:
        base = f"{self.method}-k{self.k}" if self.k is not None else self.method
        return f"{base}-{self.tag}" if self.tag else base

    @property
    def cell(self) -> dict[str, Any]:
        """The description of this cell the bench role hashes (bench_cell)."""
        return _CELLS.spark_sweep_cell(self.method, self.k, json.loads(self.extra_vars_json))

    @property
    def config_hash(self) -> str:
        return _CELLS.spark_cell_hash(self.cell)

    def extravars(self, repetition: int, results_dir: Path) -> dict[str, Any]:
        ev: dict[str, Any] = dict(json.loads(self.extra_vars_json))
        ev.update({"spec_method": self.method, "spec_num_speculative_tokens": self.k,
                   "bench_label": self.label, "bench_repetition": repetition,
                   "bench_cell": self.cell, "bench_results_dir": str(results_dir)})
        return ev


@dataclass(frozen=True)
class Cell:
    config: CellConfig
    repetition: int


@dataclass
class RunRequest:
    """What one ansible-runner invocation needs."""

    project_dir: Path
    playbook: str
    tags: str
    extravars: dict[str, Any]
    inventory: str | None
    artifact_dir: Path | None = None  # where the runner keeps stdout and events (None: thrown away)
    ident: str = "run"


@dataclass
class RunOutcome:
    ok: bool
    status: str
    rc: int
    failure: str | None = None  # "task 'X' on HOST: message", from the runner's events
    artifacts: str | None = None  # directory holding the runner's stdout and events


def _one_line(text: Any, limit: int = 600) -> str:
    line = re.sub(r"\s+", " ", str(text)).strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def failure_from_events(events: Iterable[dict[str, Any]], stdout: str = "") -> str | None:
    """The last failing task, its host and its message; else the last ERROR line of the output."""
    found: str | None = None
    for ev in events:
        if ev.get("event") not in ("runner_on_failed", "runner_on_unreachable"):
            continue
        data = ev.get("event_data") or {}
        if data.get("ignore_errors"):
            continue
        res = data.get("res") or {}
        msg = res.get("msg") or res.get("stderr") or res.get("stdout") or res.get("reason") or "no message"
        what = "unreachable" if ev["event"] == "runner_on_unreachable" else "failed"
        found = f"task '{data.get('task', '?')}' {what} on {data.get('host', '?')}: {_one_line(msg)}"
    if found is None:
        errors = [ln for ln in stdout.splitlines() if "ERROR" in ln]
        if errors:
            found = _one_line(errors[-1])
    return found


Runner = Callable[[RunRequest], RunOutcome]


def ansible_runner_run(req: RunRequest) -> RunOutcome:
    """Default runner: ansible_runner.run on the project. The private data dir (extra vars) is
    thrown away; the artifacts (stdout, events) stay in ``req.artifact_dir/req.ident`` when given."""
    import ansible_runner  # controller only, imported lazily

    envvars: dict[str, str] = {}
    if shutil.which("ansible-playbook") is None:  # e.g. a venv python started without activation
        envvars["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    with tempfile.TemporaryDirectory(prefix="sweep-runner-") as pdd:
        kwargs: dict[str, Any] = {"private_data_dir": pdd, "project_dir": str(req.project_dir),
                                  "playbook": req.playbook, "tags": req.tags, "extravars": req.extravars,
                                  "envvars": envvars or None, "quiet": True, "ident": req.ident}
        if req.artifact_dir is not None:
            req.artifact_dir.mkdir(parents=True, exist_ok=True)
            kwargs["artifact_dir"] = str(req.artifact_dir)
        if req.inventory:
            kwargs["inventory"] = req.inventory
        r = ansible_runner.run(**kwargs)
        ok = r.status == "successful"
        failure = None
        if not ok:
            try:
                stdout = r.stdout.read()
            except (OSError, AttributeError, ValueError):
                stdout = ""
            failure = failure_from_events(r.events, stdout) or f"ansible-runner {r.status} (rc {r.rc})"
        artifacts = str(Path(req.artifact_dir, req.ident)) if req.artifact_dir is not None else None
        return RunOutcome(ok=ok, status=str(r.status), rc=int(r.rc or 0), failure=failure,
                          artifacts=artifacts)


def spec_tokens_range() -> tuple[int, int]:
    """The catalogue's limits on K (filter_plugins/spark_methods.py SPEC_TOKENS_RANGE)."""
    return tuple(spark_methods.SPEC_TOKENS_RANGE)  # type: ignore[return-value]


def parse_k(args: Sequence[str], catalogue: dict[str, Any]) -> dict[str, list[int]]:
    """``["mtp=1,2,3", "dflash=5,8,12"]`` -> {method: Ks}, checked against the catalogue: the method
    must take K (``num_speculative_tokens`` in its setting_overrides) and each K lie in its range."""
    lo, hi = spec_tokens_range()
    out: dict[str, list[int]] = {}
    for a in args:
        name, _, vals = a.partition("=")
        name = name.strip()
        if name not in catalogue:
            raise UsageError(f"--k {a}: unknown method {name!r}; use METHOD=K1,K2 with a catalogue method")
        if "num_speculative_tokens" not in ((catalogue[name] or {}).get("setting_overrides") or {}):
            raise UsageError(f"--k {a}: method {name!r} takes no K (no num_speculative_tokens to set)")
        try:
            ks = [int(x) for x in vals.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--k {a}: expected METHOD=K1,K2 with integers, e.g. --k mtp=1,2,3") from None
        if not ks or any(not lo <= k <= hi for k in ks):
            raise UsageError(f"--k {a}: every K must be in {lo}..{hi} (the catalogue's limit)")
        out[name] = ks
    return out


def expand_grid(methods: Sequence[str], mtp_k: Sequence[int], extra_vars: dict[str, Any],
                known: Sequence[str] | None = None,
                ks: dict[str, list[int]] | None = None) -> list[CellConfig]:
    ev = json.dumps(extra_vars, sort_keys=True)
    known = list(known) if known is not None else list(load_settings().get("spark_method_catalogue") or {})
    ks = {"mtp": list(mtp_k), **(ks or {})}
    out: list[CellConfig] = []
    for m in methods:
        if m not in known:
            raise UsageError(f"unknown method {m!r}: choose from {', '.join(known)} (the method catalogue)")
        if m in ks:
            out.extend(CellConfig(m, k, ev) for k in ks[m])
        else:
            out.append(CellConfig(m, None, ev))
    if len({c.config_hash for c in out}) != len(out):
        raise UsageError("duplicate configurations in --methods/--mtp-k: list each method and K once")
    return out


def schedule(configs: Sequence[CellConfig], repeats: int) -> list[Cell]:
    """Interleave: every configuration once per repetition, repetitions in order."""
    return [Cell(c, rep) for rep in range(1, repeats + 1) for c in configs]


# a load point: (concurrency level or None, request rate or None, input depth; 0 = the prompt set as it is)
Point = tuple[int | None, float | None, int]


def _rate_key(r: Any) -> float | None:
    return None if r is None else round(float(r), 6)


@dataclass(frozen=True)
class LoadPoints:
    """What every cell is measured at (the bench role's lists)."""

    concurrency: tuple[int, ...]
    rates: tuple[float, ...]
    depths: tuple[int, ...]

    @property
    def points(self) -> list[Point]:
        return ([(c, None, d) for d in self.depths for c in self.concurrency]
                + [(None, _rate_key(r), d) for d in self.depths for r in self.rates])

    @staticmethod
    def of(points: Iterable[Point]) -> dict[str, str]:
        """The bench role's lists that measure ``points`` (the levels, rates and depths they name)."""
        pts = list(points)
        levels = sorted({c for c, _, _ in pts if c is not None})
        rates = sorted({r for _, r, _ in pts if r is not None})
        return {"bench_concurrency": ",".join(str(c) for c in levels),
                "bench_request_rate": ",".join(f"{r:g}" for r in rates),
                "bench_depth": ",".join(str(d) for d in sorted({d for *_, d in pts}))}


def bench_defaults(path: Path = BENCH_DEFAULTS) -> dict[str, Any]:
    """The bench role's defaults (roles/bench/defaults/main.yml, the one home of its load-point lists)."""
    import yaml  # controller only (comes with ansible-core)

    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def load_points(settings: dict[str, Any]) -> LoadPoints:
    """The load points from the settings (extra vars over group_vars; the role's defaults otherwise)."""
    settings = {**{k: v for k, v in bench_defaults().items() if k in (*LOAD_POINT_VARS, "bench_goodput")},
                **settings}
    try:
        conc_text = str(settings["bench_concurrency"] or "")
        rate_text = str(settings["bench_request_rate"] or "")
        conc = bench_cli.int_list(conc_text, "--concurrency", 1) if conc_text else []
        rates = bench_rate.rate_list(rate_text) if rate_text else []
        depths = bench_cli.int_list(str(settings["bench_depth"] or "0"), "--depth", 0)
        bench_rate.parse_goodput(str(settings["bench_goodput"] or "") or None)
    except bench_cli.UsageError as exc:
        raise UsageError(str(exc)) from None
    if not conc and not rates:
        raise UsageError("no load point: pass --concurrency and/or --request-rate (e.g. --concurrency 1)")
    return LoadPoints(tuple(conc), tuple(rates), tuple(depths))


def recorded_cells(results_dir: Path) -> set[tuple[str, int, int | None, float | None, int]]:
    """(config_hash, repetition, concurrency, request rate, input depth) of the valid runs in the store."""
    if not (results_dir / bench_store.STORE_NAME).exists():
        return set()
    conn = bench_store.open_store(results_dir)
    try:
        rows = conn.execute("SELECT config_hash, repetition, concurrency, request_rate, input_depth "
                            "FROM runs WHERE valid = 1 AND config_hash IS NOT NULL "
                            "AND repetition IS NOT NULL").fetchall()
    finally:
        conn.close()
    return {(r[0], int(r[1]), None if r[3] is not None else int(r[2] or 1), _rate_key(r[3]),
             int(r[4] or 0)) for r in rows}


class Reporter:
    """Live progress: rich when available, plain lines otherwise."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.quiet, self.done = total, quiet, 0
        self._p: Any = None
        if not quiet and sys.stdout.isatty():
            try:
                from rich.progress import Progress

                self._p = Progress()
                self._p.start()
                self._task = self._p.add_task("sweep", total=total)
            except ImportError:
                self._p = None

    def start(self, cell: Cell) -> None:
        msg = f"rep {cell.repetition}: {cell.config.label} [{cell.config.config_hash}]"
        if self._p is not None:
            self._p.update(self._task, description=msg)
        elif not self.quiet:
            print(f"[{self.done + 1}/{self.total}] {msg}", flush=True)

    def finish(self, cell: Cell, status: str) -> None:
        self.done += 1
        if self._p is not None:
            self._p.update(self._task, advance=1)
            self._p.console.print(f"{cell.config.label} rep {cell.repetition}: {status}")
        elif not self.quiet:
            print(f"    -> {status}", flush=True)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


@dataclass
class SweepResult:
    ran: list[Cell] = field(default_factory=list)
    skipped: list[Cell] = field(default_factory=list)
    failed: list[tuple[Cell, str]] = field(default_factory=list)
    report: Path | None = None
    best: CellConfig | None = None
    best_decode_median: float | None = None
    best_checked: bool = True  # the best row's outputs were compared with a baseline run
    unchecked: list[str] = field(default_factory=list)  # rows left out of the choice: outputs never checked


@dataclass
class Sweep:
    configs: list[CellConfig]
    repeats: int
    results_dir: Path
    project_dir: Path = REPO_ROOT
    inventory: str | None = None
    runner: Runner = ansible_runner_run
    playbook: str = "site.yml"
    quiet: bool = False
    charts: bool = True
    optimise_concurrency: int = 1  # the level whose best row is "best" (bench_analysis.best_row)
    optimise_rate: float | None = None  # or the offered rate whose best row is "best" (best_rate_row)
    load: LoadPoints = field(default_factory=lambda: load_points({}))  # the bench role's defaults
    allow_unchecked: bool = False  # may the best be a row whose outputs were never compared with a baseline
    baseline: str = "baseline"

    def missing(self, cell: Cell, done: set[tuple[str, int, int | None, float | None, int]]) -> list[Point]:
        """The load points of this cell that the store holds no valid run for."""
        key = (cell.config.config_hash, cell.repetition)
        return [p for p in self.load.points if (*key, *p) not in done]

    def cells(self) -> list[Cell]:
        return schedule(self.configs, self.repeats)

    def request(self, cell: Cell, tags: str = MEASURE_TAGS, only: list[Point] | None = None) -> RunRequest:
        """The runner call for a cell; ``only``: measure just these load points (a partly done cell)."""
        ident = f"{cell.config.label}-rep{cell.repetition}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        ev = cell.config.extravars(cell.repetition, self.results_dir)
        if "bench" in tags.split(","):
            ev.update(LoadPoints.of(only if only is not None else self.load.points))
            if only is not None and len(only) < len(self.load.points):
                ev["bench_force"] = True  # the role's own lookup keys on hash + repetition only
        return RunRequest(self.project_dir, self.playbook, tags, ev, self.inventory,
                          artifact_dir=self.results_dir / RUNNER_DIRNAME,
                          ident=re.sub(r"[^\w.-]", "_", ident))

    def _import(self) -> None:
        if self.results_dir.is_dir():
            bench_store.import_runs([self.results_dir], self.results_dir)

    def run(self) -> SweepResult:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self._import()
        done = recorded_cells(self.results_dir)
        res = SweepResult()
        todo = []
        for cell in self.cells():
            (todo if self.missing(cell, done) else res.skipped).append(cell)
        rep = Reporter(len(todo), self.quiet)
        try:
            for cell in todo:
                rep.start(cell)
                outcome = self.runner(self.request(cell, only=self.missing(cell, done)))
                self._import()
                done = recorded_cells(self.results_dir)
                recorded = not self.missing(cell, done)
                if outcome.ok and recorded:
                    res.ran.append(cell)
                    rep.finish(cell, "ok")
                else:
                    why = ((outcome.failure or f"ansible-runner {outcome.status} (rc {outcome.rc})")
                           if not outcome.ok
                           else "no valid run recorded (see the run's problems in the report)")
                    if outcome.artifacts:
                        why += f" [runner output: {outcome.artifacts}]"
                    res.failed.append((cell, why))
                    rep.finish(cell, f"FAILED: {why}")
        finally:
            rep.close()
        self.finish(res)
        return res

    def finish(self, res: SweepResult) -> None:
        if not (self.results_dir / bench_store.STORE_NAME).exists():
            return
        res.report, stats = bench_report.make_report(self.results_dir, charts=self.charts)
        by_hash = {c.config_hash: c for c in self.configs}
        ours = [s for s in stats if s.config_hash in by_hash]
        only = None if self.allow_unchecked else self.baseline
        top = (bench_analysis.best_rate_row(ours, self.optimise_rate, only) if self.optimise_rate is not None
               else bench_analysis.best_row(ours, self.optimise_concurrency, only))
        res.unchecked = sorted({s.base_label for s in ours if not bench_analysis.checked(s, self.baseline)})
        if top is not None:
            res.best, res.best_decode_median = by_hash[top.config_hash], top.decode["median"]
            res.best_checked = bench_analysis.checked(top, self.baseline)

    def leave_best(self, best: CellConfig) -> RunOutcome:
        return self.runner(self.request(Cell(best, 0), tags=SERVE_TAGS))


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("sweep.py", __doc__)
    p.add_argument("--methods", default=None,
                   help="comma-separated methods (default: the catalogue's methods whose requirements "
                        "are met; the others are named with the reason)")
    p.add_argument("--mtp-k", type=_ints, default=[2], help="comma-separated K values for mtp")
    p.add_argument("--k", action="append", default=[], metavar="METHOD=K1,K2",
                   help="K values for any speculative method, e.g. --k mtp=1,2,3 --k dflash=5,8,12 "
                        "(checked against the catalogue's limits)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every configuration")
    p.add_argument("--inventory", default=str(REPO_ROOT / "inventory" / "hosts.yml"),
                   help="Ansible inventory (any path)")
    p.add_argument("--results", default=str(REPO_ROOT / "results"),
                   help="results directory (store, report/, runner/)")
    p.add_argument("--leave-best", action="store_true",
                   help="rerun the serve stage for the best config (valid runs, outputs same as baseline)")
    p.add_argument("--allow-unchecked", action="store_true",
                   help="let --leave-best and the best configuration be a method whose outputs were never "
                        "compared with a baseline run (default: such methods are left out of the choice)")
    p.add_argument("--optimise-concurrency", type=int, default=None,
                   help="the concurrency level the best configuration is chosen at, one of --concurrency "
                        "(default 1)")
    p.add_argument("--optimise-rate", type=float, default=None,
                   help="choose the best configuration at this offered request rate instead (highest "
                        "goodput); one of --request-rate (default: none, choose at --optimise-concurrency)")
    p.add_argument("--concurrency", default=None,
                   help="concurrency levels every cell is measured at, e.g. 1,2,4 (default 1; sets "
                        "bench_concurrency)")
    p.add_argument("--request-rate", default=None,
                   help="offered request rates (Poisson arrivals, req/s) every cell is measured at, e.g. "
                        "0.5,1,2 (sets bench_request_rate; without --concurrency only rates are measured; "
                        "default: none)")
    p.add_argument("--goodput", default=None,
                   help="goodput targets of the rate runs, e.g. ttft=2000ms,tpot=100ms (sets bench_goodput; "
                        "default: none)")
    p.add_argument("--depth", default=None, help="input depths, e.g. 0,8192 (sets bench_depth; default: 0)")
    p.add_argument("--extra-vars", default="{}", help="JSON object passed to every run")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def choose_methods(arg: str | None, settings: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(methods to sweep, method -> why it is left out or only warned about)."""
    problems = method_problems(settings)
    catalogue = list(settings.get("spark_method_catalogue") or {})
    if arg is None:
        return [m for m in catalogue if m not in problems], problems
    methods = [m.strip() for m in arg.split(",") if m.strip()]
    if not methods:
        raise UsageError("--methods is empty: list at least one method, e.g. --methods baseline,mtp")
    for m in methods:
        entry = (settings.get("spark_method_catalogue") or {}).get(m, {})
        missing = [k for k in entry.get("requires") or [] if not _is_set(settings.get(k))]
        if missing:
            raise UsageError(f"method {m!r} {problems[m]}")
    return methods, {m: why for m, why in problems.items() if m in methods}


def check_results_dir(results: Path) -> None:
    """UsageError (the path and the fix) before any cell unless the results directory, its store and its
    report can be written: a sweep that cannot record its cells would run them for nothing."""
    from sparkllm.outdir import OutputRefused, probe_writable

    try:
        probe_writable(results, "--results")
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    bench_store.check_store(results / bench_store.STORE_NAME)
    bench_store.check_writable(results / bench_store.STORE_NAME)


def main(argv: list[str] | None = None, runner: Runner | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run_main("sweep.py", lambda: _main(a, runner))


def _needs_decode(a: argparse.Namespace) -> bool:
    """Whether the command line asks for what only the decode profile measures: a load level other than one
    stream, a request rate, an input depth."""
    conc = str(a.concurrency or "1").replace(" ", "")
    return conc != "1" or a.request_rate is not None or str(a.depth or "0").replace(" ", "") not in ("0", "")


def extra_vars(text: str) -> dict[str, Any]:
    """--extra-vars as a dict; UsageError unless it is a JSON object."""
    try:
        extra = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--extra-vars must be a JSON object: {exc}") from None
    if not isinstance(extra, dict):
        raise UsageError("--extra-vars must be a JSON object, e.g. '{\"bench_repeats\": 2}'")
    return extra


def _main(a: argparse.Namespace, runner: Runner | None) -> int:
    extra = extra_vars(a.extra_vars)
    if a.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    lo, hi = spec_tokens_range()
    if not a.mtp_k or any(not lo <= k <= hi for k in a.mtp_k):
        raise UsageError(f"--mtp-k {','.join(map(str, a.mtp_k))}: every K must be in {lo}..{hi} (the "
                         "catalogue's limit), e.g. --mtp-k 1,2,4")
    if a.optimise_concurrency is not None and a.optimise_concurrency < 1:
        raise UsageError(f"--optimise-concurrency {a.optimise_concurrency}: must be a concurrency level >= 1")
    if a.inventory and "," not in a.inventory and not Path(a.inventory).exists():  # "host1,host2," is a list
        raise UsageError(f"--inventory {a.inventory}: no such file; pass your inventory "
                         "(e.g. a copy of inventory/examples/remote-spark.yml)")
    for flag, var in (("concurrency", "bench_concurrency"), ("request_rate", "bench_request_rate"),
                      ("goodput", "bench_goodput"), ("depth", "bench_depth")):
        if getattr(a, flag) is not None:
            extra[var] = getattr(a, flag)
    if a.request_rate is not None and a.concurrency is None and "bench_concurrency" not in extra:
        extra["bench_concurrency"] = ""  # rates only
    if "bench_profile" not in extra and _needs_decode(a):
        # load levels, rates and depths are the decode profile's: the bench stage's default, records,
        # measures one stream of whole requests and refuses them
        extra["bench_profile"] = "decode"
    settings = {**load_settings(), **extra}
    load = load_points(settings)
    if a.optimise_rate is not None and _rate_key(a.optimise_rate) not in {_rate_key(r) for r in load.rates}:
        raise UsageError(f"--optimise-rate {a.optimise_rate:g}: not one of the measured rates "
                         f"({','.join(f'{r:g}' for r in load.rates) or 'none: pass --request-rate'})")
    if a.optimise_concurrency is not None and a.optimise_concurrency not in load.concurrency:
        raise UsageError(f"--optimise-concurrency {a.optimise_concurrency}: not one of the measured levels "
                         f"({','.join(map(str, load.concurrency)) or 'none: pass --concurrency'})")
    ks = {**DEFAULT_K, **parse_k(a.k, settings.get("spark_method_catalogue") or {})}  # up front
    methods, notes = choose_methods(a.methods, settings)
    for m, why in notes.items():
        verb = "may fail" if m in methods else "left out"
        print(f"{m}: {verb}: {why}", file=sys.stderr)
    if not methods:
        raise UsageError("no method can be swept with these settings (see above); pass --methods")
    known = list(settings.get("spark_method_catalogue") or {})
    check_results_dir(Path(a.results).resolve())
    sw = Sweep(expand_grid(methods, a.mtp_k, extra, known, ks), a.repeats, Path(a.results).resolve(),
               inventory=a.inventory, runner=runner or ansible_runner_run, quiet=a.quiet,
               optimise_concurrency=a.optimise_concurrency or 1, optimise_rate=a.optimise_rate, load=load,
               allow_unchecked=a.allow_unchecked)
    res = sw.run()
    print(f"ran {len(res.ran)}, skipped {len(res.skipped)} (already recorded), failed {len(res.failed)}")
    for cell, why in res.failed:
        print(f"  FAILED {cell.config.label} rep {cell.repetition}: {why}")
    if res.report:
        print(f"report: {res.report}")
    if res.unchecked:
        verb = "may be chosen (--allow-unchecked)" if a.allow_unchecked else "left out of the choice"
        print(f"outputs not checked (no baseline run to compare with), {verb}: {', '.join(res.unchecked)}; "
              f"add baseline to --methods to check them")
    if a.leave_best and res.best is None and res.unchecked and not a.allow_unchecked:
        print("sweep.py: error: --leave-best refused: no configuration's outputs were compared with a "
              "baseline run, so a method that garbles answers cannot be told from a right one; add baseline "
              "to --methods, or pass --allow-unchecked to choose among unchecked methods", file=sys.stderr)
        return 1
    if res.best:
        print(f"best configuration: {res.best.label} (spec_method={res.best.method}, "
              f"spec_num_speculative_tokens={res.best.k}, median decode {res.best_decode_median:.2f} tok/s"
              + ("" if res.best_checked else "; OUTPUTS NOT CHECKED") + ")")
        if a.leave_best:
            out = sw.leave_best(res.best)
            print(f"left {res.best.label} serving: {out.status}"
                  + (f" ({out.failure})" if out.failure else ""))
            if not out.ok:
                return 1
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
