#!/usr/bin/python3
"""Test-host only: a /proc/meminfo that tells the truth about the container's memory limit.

Inside a container /proc/meminfo is the machine's (24 GiB here), so a memory guard in the test host
would never see the limit molecule gives it. This writes the figures of the container's own memory
cgroup (cgroup v1 or v2: limit, usage, reclaimable page cache) to a file in meminfo's format every
--interval seconds; ``--bind`` mounts it over /proc/meminfo first (what lxcfs does with FUSE).

Every figure is written with a fixed width and the file is rewritten in place (same inode, same
length, one write), so a reader that keeps it open (earlyoom rewinds and rereads it) never sees it
empty or short. MemAvailable = limit - usage + inactive page cache, as the kernel counts reclaimable.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

FIELDS = ("MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "SwapCached", "Active", "Inactive",
          "SwapTotal", "SwapFree", "Shmem")


def own_cgroup() -> tuple[Path, int]:
    """The container's memory cgroup directory (the parent of PID 1's init.scope) and its version."""
    for line in Path("/proc/1/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if "memory" in ctrl.split(","):
            root = Path("/sys/fs/cgroup/memory" + path)
            return (root.parent if root.name == "init.scope" else root), 1
    path = Path("/proc/1/cgroup").read_text().splitlines()[0].split(":", 2)[2]
    root = Path("/sys/fs/cgroup" + path)
    return (root.parent if root.name == "init.scope" else root), 2


def figures(cg: Path, version: int, ram: int) -> dict[str, int]:
    stat = dict(line.split() for line in (cg / "memory.stat").read_text().splitlines())
    if version == 1:
        limit = min(int((cg / "memory.limit_in_bytes").read_text()), ram)
        usage = int((cg / "memory.usage_in_bytes").read_text())
        inactive_file = int(stat.get("total_inactive_file", 0))
        cache = int(stat.get("total_cache", 0))
    else:
        raw = (cg / "memory.max").read_text().strip()
        limit = ram if raw == "max" else min(int(raw), ram)
        usage = int((cg / "memory.current").read_text())
        inactive_file = int(stat.get("inactive_file", 0))
        cache = int(stat.get("file", 0))
    usage = min(usage, limit)
    kib = {
        "MemTotal": limit, "MemFree": limit - usage,
        "MemAvailable": min(limit, limit - usage + inactive_file),
        "Buffers": 0, "Cached": cache, "SwapCached": 0, "Active": max(0, usage - inactive_file),
        "Inactive": inactive_file, "SwapTotal": 0, "SwapFree": 0, "Shmem": 0,
    }
    return {k: v // 1024 for k, v in kib.items()}


def render(fig: dict[str, int]) -> bytes:
    return "".join(f"{k + ':':<16}{fig[k]:>12} kB\n" for k in FIELDS).encode()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--bind", action="store_true", help="bind-mount --out over /proc/meminfo first")
    a = p.parse_args()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cg, version = own_cgroup()
    a.out.write_bytes(render(figures(cg, version, ram)))
    if a.bind:
        subprocess.run(["mount", "--bind", str(a.out), "/proc/meminfo"], check=True)
    shown = f"{a.out} -> /proc/meminfo" if a.bind else str(a.out)
    print(f"meminfo of {cg} (cgroup v{version}) -> {shown}", flush=True)
    fd = os.open(a.out, os.O_WRONLY)
    while True:
        os.pwrite(fd, render(figures(cg, version, ram)), 0)
        time.sleep(a.interval)


if __name__ == "__main__":
    sys.exit(main())
