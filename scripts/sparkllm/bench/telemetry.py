"""bench: GPU telemetry during the measured phase (standard library only; runs on the Spark).

A thread samples ``nvidia-smi --query-gpu=power.draw,temperature.gpu,clocks.sm,clocks.max.sm,
clocks_throttle_reasons.active --format=csv,noheader,nounits`` and ``/proc/meminfo``'s MemAvailable
(GB10 reports memory.used as [N/A]: its memory is the host's). Energy is the trapezoid integral of
power over the samples' monotonic times. A run is marked (a warning, not invalid) when its SM clock
fell below ``CLOCK_DROP`` of the phase's highest clock or its temperature reached ``THROTTLE_TEMP_C``.
A host without nvidia-smi records no samples and says so.
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any

from sparkllm.gpu_smi import MEMINFO, SmiError, mem_available_mib, num, query

QUERY = "power.draw,temperature.gpu,clocks.sm"
THROTTLE_TEMP_C = 85.0  # GB10's slowdown point is not published; 85 C is where we warn
CLOCK_DROP = 0.85  # an SM clock below 85 % of the run's highest reading counts as a drop
__all__ = ["MEMINFO", "Telemetry", "energy_j", "mem_available_mib", "summarise"]


class Telemetry(threading.Thread):
    def __init__(self, interval: float = 1.0, exe: str | None = None) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.exe = exe if exe is not None else shutil.which("nvidia-smi")
        self.samples: list[dict[str, Any]] = []
        self.error: str | None = None
        self.stop_evt = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> None:
        t = time.monotonic() - self.t0
        row: dict[str, Any] = {"t_s": round(t, 4), "mem_available_mib": mem_available_mib()}
        if self.exe:
            try:
                first = query(self.exe, QUERY.split(","))[0]  # sparkllm.gpu_smi (the GB10 exporter's too)
                row.update(power_w=num(first["power.draw"]), temp_c=num(first["temperature.gpu"]),
                           sm_clock_mhz=num(first["clocks.sm"]))
            except SmiError as exc:
                self.error = str(exc)[:200]
        self.samples.append(row)

    def run(self) -> None:
        while True:
            self.sample()
            if self.stop_evt.wait(self.interval):
                break

    def stop(self) -> None:
        self.stop_evt.set()
        self.join()
        self.sample()  # the end of the phase, so the integral spans all of it

    def summary(self, output_tokens: int) -> dict[str, Any]:
        return summarise(self.samples, output_tokens, self.exe is not None, self.error)


def energy_j(samples: list[dict[str, Any]]) -> float | None:
    pts = [(s["t_s"], s["power_w"]) for s in samples if s.get("power_w") is not None]
    if len(pts) < 2:
        return None
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(pts, pts[1:], strict=False))


def summarise(samples: list[dict[str, Any]], output_tokens: int, have_smi: bool,
              error: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"source": "nvidia-smi" if have_smi else None, "samples": samples,
                           "energy_j": None, "j_per_output_token": None, "power_w_mean": None,
                           "temp_c_max": None, "sm_clock_mhz_min": None, "sm_clock_mhz_max": None,
                           "warnings": [], "note": None, "error": error}
    mem = [s["mem_available_mib"] for s in samples if s.get("mem_available_mib") is not None]
    out["mem_available_mib_min"] = min(mem) if mem else None
    if not have_smi:
        out["note"] = "no nvidia-smi on this host: no power, temperature or clock figures"
        return out
    e = energy_j(samples)
    out["energy_j"] = e
    if e is not None and output_tokens:
        out["j_per_output_token"] = e / output_tokens
    power = [s["power_w"] for s in samples if s.get("power_w") is not None]
    temps = [s["temp_c"] for s in samples if s.get("temp_c") is not None]
    clocks = [s["sm_clock_mhz"] for s in samples if s.get("sm_clock_mhz") is not None]
    if power:
        out["power_w_mean"] = sum(power) / len(power)
    if temps:
        out["temp_c_max"] = max(temps)
        if max(temps) >= THROTTLE_TEMP_C:
            out["warnings"].append(f"temperature reached {max(temps):g} C "
                                   f"(throttle point {THROTTLE_TEMP_C:g} C)")
    if clocks:
        lo, hi = min(clocks), max(clocks)
        out["sm_clock_mhz_min"], out["sm_clock_mhz_max"] = lo, hi
        if hi > 0 and lo < CLOCK_DROP * hi:
            out["warnings"].append(f"SM clock dropped to {lo:g} MHz from {hi:g} MHz "
                                   "during the measured phase")
    return out
