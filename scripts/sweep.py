#!/usr/bin/env python3
"""Method sweep (controller): serve + bench every configuration, interleaved, resumable.

    sweep.py --methods baseline,ngram,mtp,eagle3,dflash [--mtp-k 1,2,4] [--repeats N]
             [--inventory INV] [--results DIR] [--leave-best] [--extra-vars JSON]

Grid: one configuration per method; ``mtp`` expands to one per ``--mtp-k`` value (other methods
use the catalogue's default K: ``spec_num_speculative_tokens`` null).  Schedule: methods are
interleaved across repetitions (rep 1: every configuration, rep 2: every configuration, ...), so
slow drifts (thermals, page cache) hit every method alike and the report can pair runs by
repetition index.  Each cell drives ``site.yml`` through ansible-runner with tags
``serve,bench`` and extravars ``spec_method``, ``spec_num_speculative_tokens``, ``bench_label``,
``bench_repetition``, ``bench_config_hash`` (plus ``bench_results_dir``, the controller results
directory, and anything from ``--extra-vars``).

Configuration hash: sha256 over the canonical JSON of {method, k, extra_vars}, first 16 hex
digits.  Resume: a cell is skipped when the store already holds a *valid* run with the same
configuration hash and repetition (invalid runs are retried).  The end: ``bench.py report`` on
the results directory and the best configuration (highest median decode tok/s over valid runs);
``--leave-best`` reruns the serve stage for it.

The ansible-runner call is injectable (``Sweep(runner=...)``) so tests replace it with a fake.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench

REPO_ROOT = Path(__file__).resolve().parent.parent
KNOWN_METHODS = ("baseline", "ngram", "mtp", "eagle3", "dflash")


@dataclass(frozen=True)
class CellConfig:
    """One server configuration of the grid."""

    method: str
    k: int | None = None
    extra_vars_json: str = "{}"

    @property
    def label(self) -> str:
        return f"{self.method}-k{self.k}" if self.k is not None else self.method

    @property
    def config_hash(self) -> str:
        body = {"method": self.method, "k": self.k, "extra_vars": json.loads(self.extra_vars_json)}
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def extravars(self, repetition: int, results_dir: Path) -> dict[str, Any]:
        ev: dict[str, Any] = dict(json.loads(self.extra_vars_json))
        ev.update({"spec_method": self.method, "spec_num_speculative_tokens": self.k,
                   "bench_label": self.label, "bench_repetition": repetition,
                   "bench_config_hash": self.config_hash, "bench_results_dir": str(results_dir)})
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


@dataclass
class RunOutcome:
    ok: bool
    status: str
    rc: int


Runner = Callable[[RunRequest], RunOutcome]


def ansible_runner_run(req: RunRequest) -> RunOutcome:
    """Default runner: ansible_runner.run on the project, in a throw-away private data dir."""
    import ansible_runner  # controller only, imported lazily

    envvars: dict[str, str] = {}
    if shutil.which("ansible-playbook") is None:  # e.g. a venv python started without activation
        envvars["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    with tempfile.TemporaryDirectory(prefix="sweep-runner-") as pdd:
        kwargs: dict[str, Any] = {"private_data_dir": pdd, "project_dir": str(req.project_dir),
                                  "playbook": req.playbook, "tags": req.tags, "extravars": req.extravars,
                                  "envvars": envvars or None, "quiet": True}
        if req.inventory:
            kwargs["inventory"] = req.inventory
        r = ansible_runner.run(**kwargs)
        return RunOutcome(ok=r.status == "successful", status=str(r.status), rc=int(r.rc or 0))


def expand_grid(methods: Sequence[str], mtp_k: Sequence[int], extra_vars: dict[str, Any]) -> list[CellConfig]:
    ev = json.dumps(extra_vars, sort_keys=True)
    out: list[CellConfig] = []
    for m in methods:
        if m not in KNOWN_METHODS:
            raise SystemExit(f"unknown method {m!r}: choose from {', '.join(KNOWN_METHODS)}")
        if m == "mtp":
            out.extend(CellConfig(m, k, ev) for k in mtp_k)
        else:
            out.append(CellConfig(m, None, ev))
    if len({c.config_hash for c in out}) != len(out):
        raise SystemExit("duplicate configurations in --methods/--mtp-k")
    return out


def schedule(configs: Sequence[CellConfig], repeats: int) -> list[Cell]:
    """Interleave: every configuration once per repetition, repetitions in order."""
    return [Cell(c, rep) for rep in range(1, repeats + 1) for c in configs]


def recorded_cells(results_dir: Path) -> set[tuple[str, int]]:
    """(config_hash, repetition) of the valid runs in the store."""
    if not (results_dir / bench.STORE_NAME).exists():
        return set()
    conn = bench.open_store(results_dir)
    try:
        rows = conn.execute("SELECT config_hash, repetition FROM runs WHERE valid = 1 "
                            "AND config_hash IS NOT NULL AND repetition IS NOT NULL").fetchall()
    finally:
        conn.close()
    return {(r[0], int(r[1])) for r in rows}


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

    def cells(self) -> list[Cell]:
        return schedule(self.configs, self.repeats)

    def request(self, cell: Cell, tags: str = "serve,bench") -> RunRequest:
        return RunRequest(self.project_dir, self.playbook, tags,
                          cell.config.extravars(cell.repetition, self.results_dir), self.inventory)

    def _import(self) -> None:
        if self.results_dir.is_dir():
            bench.import_runs([self.results_dir], self.results_dir)

    def run(self) -> SweepResult:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self._import()
        done = recorded_cells(self.results_dir)
        res = SweepResult()
        todo = []
        for cell in self.cells():
            (res.skipped if (cell.config.config_hash, cell.repetition) in done else todo).append(cell)
        rep = Reporter(len(todo), self.quiet)
        try:
            for cell in todo:
                rep.start(cell)
                outcome = self.runner(self.request(cell))
                self._import()
                recorded = (cell.config.config_hash, cell.repetition) in recorded_cells(self.results_dir)
                if outcome.ok and recorded:
                    res.ran.append(cell)
                    rep.finish(cell, "ok")
                else:
                    why = (f"ansible-runner {outcome.status} (rc {outcome.rc})" if not outcome.ok
                           else "no valid run recorded (see the run's problems in the report)")
                    res.failed.append((cell, why))
                    rep.finish(cell, f"FAILED: {why}")
        finally:
            rep.close()
        self.finish(res)
        return res

    def finish(self, res: SweepResult) -> None:
        if not (self.results_dir / bench.STORE_NAME).exists():
            return
        res.report, stats = bench.make_report(self.results_dir, charts=self.charts)
        by_label = {c.label: c for c in self.configs}
        ranked = [s for s in stats if s.label in by_label and s.decode["median"] is not None]
        if ranked:
            top = max(ranked, key=lambda s: s.decode["median"])
            res.best, res.best_decode_median = by_label[top.label], top.decode["median"]

    def leave_best(self, best: CellConfig) -> RunOutcome:
        return self.runner(self.request(Cell(best, 0), tags="serve"))


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sweep.py", description="Serve + bench every method configuration.")
    p.add_argument("--methods", default="baseline,ngram,mtp,eagle3,dflash")
    p.add_argument("--mtp-k", type=_ints, default=[2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--inventory", default=str(REPO_ROOT / "inventory" / "hosts.yml"))
    p.add_argument("--results", default=str(REPO_ROOT / "results"))
    p.add_argument("--leave-best", action="store_true", help="rerun the serve stage for the best config")
    p.add_argument("--extra-vars", default="{}", help="JSON object passed to every run")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None, runner: Runner | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        extra = json.loads(a.extra_vars)
    except ValueError as exc:
        raise SystemExit(f"--extra-vars must be a JSON object: {exc}") from exc
    if not isinstance(extra, dict):
        raise SystemExit("--extra-vars must be a JSON object")
    if a.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    sw = Sweep(expand_grid(methods, a.mtp_k, extra), a.repeats, Path(a.results).resolve(),
               inventory=a.inventory, runner=runner or ansible_runner_run, quiet=a.quiet)
    res = sw.run()
    print(f"ran {len(res.ran)}, skipped {len(res.skipped)} (already recorded), failed {len(res.failed)}")
    for cell, why in res.failed:
        print(f"  FAILED {cell.config.label} rep {cell.repetition}: {why}")
    if res.report:
        print(f"report: {res.report}")
    if res.best:
        print(f"best configuration: {res.best.label} (spec_method={res.best.method}, "
              f"spec_num_speculative_tokens={res.best.k}, median decode {res.best_decode_median:.2f} tok/s)")
        if a.leave_best:
            out = sw.leave_best(res.best)
            print(f"left {res.best.label} serving: {out.status}")
            if not out.ok:
                return 1
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
