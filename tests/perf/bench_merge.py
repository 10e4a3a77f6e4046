#!/usr/bin/env python3
"""Benchmark the streaming hybrid merge against `cp` of the same bytes on the same disk.

    python tests/perf/bench_merge.py --size-gb 8 --workdir DIR [--double] [--keep]

Generates a checkpoint pair (INT4 >= --size-gb, FP8 as a small fp8-extract file) under
DIR/bench-merge-<pid>/, then times, with cold page cache for the inputs (posix_fadvise DONTNEED
after sync) and including the final flush to disk for both:
  * `cp --reflink=never` of the INT4 *.safetensors files (about the same bytes as the merge output),
  * scripts/hybrid_merge.py as a subprocess; its peak RSS comes from os.wait4's rusage.
cp and merge alternate --reps times (default 3; shared disks are noisy) and medians are used.
Prints throughput (output bytes / second) of each, the ratio merge/cp (goal >= 0.8) and the merge's
peak RSS in MiB (goal <= 256 and flat). --double repeats at twice the size to show RSS stays flat.
Everything generated is removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout: tests.* when run as a script
from tests.fixtures.make_checkpoints import bench_config, generate  # noqa: E402

MERGE = ROOT / "scripts" / "hybrid_merge.py"


@dataclass
class Round:
    size_bytes: int
    cp_seconds: float
    cp_bytes: int
    merge_seconds: float
    merge_bytes: int
    merge_rss_mib: float

    @property
    def cp_mbps(self) -> float:
        return self.cp_bytes / self.cp_seconds / 1e6

    @property
    def merge_mbps(self) -> float:
        return self.merge_bytes / self.merge_seconds / 1e6

    @property
    def ratio(self) -> float:
        return self.merge_mbps / self.cp_mbps


def evict(paths: list[Path]) -> None:
    """Flush and drop these files from the page cache (no root needed)."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_in(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def run_wait4(argv: list[str]) -> tuple[float, float, str]:
    """(seconds, peak RSS MiB, stdout) of a child process (stdout must be small)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - start
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed with exit code {proc.returncode}")
    return seconds, usage.ru_maxrss / 1024, out


def time_cp(inputs: list[Path], shards: list[Path], cp_dir: Path) -> tuple[float, int]:
    evict(inputs)
    cp_dir.mkdir()
    start = time.monotonic()
    subprocess.run(["cp", "--reflink=never", *map(str, shards), str(cp_dir)], check=True)
    os.sync()
    seconds = time.monotonic() - start
    nbytes = sum(p.stat().st_size for p in cp_dir.iterdir())
    shutil.rmtree(cp_dir)
    os.sync()
    return seconds, nbytes


def time_merge(inputs: list[Path], int4: Path, fp8: Path, out: Path) -> tuple[float, int, float]:
    evict(inputs)
    argv = [sys.executable, str(MERGE), "--int4", str(int4), "--fp8", str(fp8), "--out", str(out), "--json"]
    seconds, rss, stdout = run_wait4(argv)
    print(f"  merge {seconds:.1f}s, phases (s): {json.loads(stdout).get('phases')}", flush=True)
    nbytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    shutil.rmtree(out)
    os.sync()
    return seconds, nbytes, rss


def one_round(work: Path, size_bytes: int, reps: int) -> Round:
    """Interleaved cp / merge repetitions; medians of the times, max of the peak RSS."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.monotonic()
    pair = generate(work, bench_config(size_bytes))
    print(f"  generated {pair.int4_bytes / 1e9:.2f} GB INT4 pair in {time.monotonic() - t0:.0f}s", flush=True)
    inputs = files_in(pair.int4_dir) + files_in(pair.fp8_dir)
    shards = sorted(pair.int4_dir.glob("*.safetensors"))
    cps: list[float] = []
    merges: list[float] = []
    rss_max = 0.0
    cp_bytes = merge_bytes = 0
    for _ in range(reps):
        seconds, cp_bytes = time_cp(inputs, shards, work / "cp")
        print(f"  cp {seconds:.1f}s", flush=True)
        cps.append(seconds)
        seconds, merge_bytes, rss = time_merge(inputs, pair.int4_dir, pair.fp8_dir, work / "merged")
        merges.append(seconds)
        rss_max = max(rss_max, rss)
    return Round(
        size_bytes, statistics.median(cps), cp_bytes, statistics.median(merges), merge_bytes, rss_max
    )


def report(r: Round) -> None:
    print(
        f"size {r.size_bytes / 1e9:.1f} GB: cp {r.cp_bytes / 1e9:.2f} GB in {r.cp_seconds:.1f}s "
        f"({r.cp_mbps:.0f} MB/s); merge {r.merge_bytes / 1e9:.2f} GB in {r.merge_seconds:.1f}s "
        f"({r.merge_mbps:.0f} MB/s); throughput ratio merge/cp {r.ratio:.2f}; "
        f"merge peak RSS {r.merge_rss_mib:.1f} MiB",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=8.0, help="INT4 checkpoint size to generate (GB, 1e9)")
    p.add_argument("--workdir", type=Path, required=True, help="scratch directory on the disk to measure")
    p.add_argument("--double", action="store_true", help="repeat at twice the size (RSS flatness)")
    p.add_argument("--keep", action="store_true", help="keep generated files")
    p.add_argument("--reps", type=int, default=3, help="interleaved cp/merge repetitions (medians reported)")
    a = p.parse_args(argv)
    size = int(a.size_gb * 1e9)
    need = 3.2 * size * (2 if a.double else 1)
    free = shutil.disk_usage(a.workdir).free
    if need > free:
        print(
            f"need about {need / 1e9:.0f} GB free in {a.workdir}, have {free / 1e9:.0f} GB", file=sys.stderr
        )
        return 1
    work = a.workdir / f"bench-merge-{os.getpid()}"
    rounds: list[Round] = []
    try:
        for s in [size, 2 * size] if a.double else [size]:
            print(f"round at {s / 1e9:.1f} GB", flush=True)
            rounds.append(one_round(work, s, a.reps))
            report(rounds[-1])
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    if len(rounds) == 2:
        growth = rounds[1].merge_rss_mib / rounds[0].merge_rss_mib
        print(f"peak RSS growth when the checkpoint doubles: x{growth:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
