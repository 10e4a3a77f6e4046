#!/usr/bin/env python3
"""GB10 exporter: the Spark's GPU power, temperature, clocks and throttle reasons, and its unified
memory, in Prometheus' text format (standard library only; runs on the Spark).

    gb10_exporter.py [--listen 127.0.0.1] [--port 9835] [--nvidia-smi PATH] [--meminfo PATH]
    gb10_exporter.py --once        # print one scrape to stdout and exit (0 done, 1 nothing read)

Each scrape of ``/metrics`` runs ``nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits``
once (sparkllm.gpu_smi, the parser the benchmark's telemetry uses) and reads /proc/meminfo. A field
GB10 reports as [N/A] (memory.used and memory.total: NVML has no separate GPU memory there) is left
out, not exported as 0; the memory figures come from /proc/meminfo instead. Without nvidia-smi (or
when it fails) the scrape still answers: ``gb10_nvidia_smi_up 0`` and the memory figures.
Exit status: 0 done, 1 the listening socket could not be opened, 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparkllm.gpu_smi import MEMINFO, SmiError, bitmask, meminfo, num, query  # noqa: E402

# (nvidia-smi field, metric, help, scale to the metric's unit)
GAUGES = (
    ("power.draw", "gb10_power_draw_watts", "GPU power draw (W).", 1.0),
    ("temperature.gpu", "gb10_temperature_celsius", "GPU temperature (C).", 1.0),
    ("clocks.sm", "gb10_sm_clock_hertz", "Current SM clock (Hz).", 1e6),
    ("clocks.max.sm", "gb10_sm_clock_max_hertz", "Maximum SM clock (Hz).", 1e6),
    ("utilization.gpu", "gb10_utilization_ratio", "GPU utilization (0..1).", 0.01),
    ("memory.used", "gb10_nvml_memory_used_bytes", "NVML memory used (absent on GB10: [N/A]).", 1048576.0),
    ("memory.total", "gb10_nvml_memory_total_bytes", "NVML memory total (absent on GB10: [N/A]).", 1048576.0),
)
THROTTLE_FIELD = "clocks_throttle_reasons.active"
FIELDS = tuple(f for f, *_ in GAUGES) + (THROTTLE_FIELD,)
# NVML's clocks event (throttle) reason bits (nvmlClocksEventReason*), one gauge each
THROTTLE_BITS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"), (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"),
)
# /proc/meminfo key -> metric
MEMINFO_GAUGES = (
    ("MemTotal", "gb10_memory_total_bytes", "Unified memory total (/proc/meminfo MemTotal)."),
    ("MemAvailable", "gb10_memory_available_bytes", "Unified memory available (/proc/meminfo MemAvailable)."),
    ("SwapTotal", "gb10_swap_total_bytes", "Swap total (/proc/meminfo)."),
    ("SwapFree", "gb10_swap_free_bytes", "Swap free (/proc/meminfo)."),
)


def _fmt(v: float) -> str:
    return repr(float(v))


def _block(name: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    if not samples:
        return []
    out = [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
    out += [f"{name}{labels} {_fmt(v)}" for labels, v in samples]
    return out


def render(smi_rows: list[dict[str, str]] | None, mem: dict[str, int], smi_error: str | None = None,
           duration_s: float | None = None) -> str:
    """The exposition text of one scrape (smi_rows None: nvidia-smi missing or failed)."""
    lines: list[str] = []
    lines += _block("gb10_nvidia_smi_up", "1 when nvidia-smi answered this scrape.",
                    [("", 1.0 if smi_rows else 0.0)])
    for field, metric, help_, scale in GAUGES:
        samples = []
        for i, row in enumerate(smi_rows or []):
            value = num(row.get(field, ""))
            if value is not None:
                samples.append((f'{{gpu="{i}"}}', value * scale))
        lines += _block(metric, help_, samples)
    masks = [(i, bitmask(row.get(THROTTLE_FIELD, ""))) for i, row in enumerate(smi_rows or [])]
    masks = [(i, m) for i, m in masks if m is not None]
    lines += _block("gb10_clocks_throttle_reasons_bitmask", "clocks_throttle_reasons.active as a number.",
                    [(f'{{gpu="{i}"}}', float(m)) for i, m in masks])
    lines += _block("gb10_clocks_throttle_reason_active", "1 when that throttle reason is active.",
                    [(f'{{gpu="{i}",reason="{name}"}}', 1.0 if m & bit else 0.0)
                     for i, m in masks for bit, name in THROTTLE_BITS])
    for key, metric, help_ in MEMINFO_GAUGES:
        if key in mem:
            lines += _block(metric, help_, [("", float(mem[key]))])
    if duration_s is not None:
        lines += _block("gb10_scrape_duration_seconds", "Time this scrape took.", [("", duration_s)])
    if smi_error:
        lines.append(f"# nvidia-smi: {smi_error.replace(chr(10), ' ')[:200]}")
    return "\n".join(lines) + "\n"


class Collector:
    def __init__(self, exe: str | None, meminfo_path: Path = MEMINFO) -> None:
        self.exe = exe
        self.meminfo_path = meminfo_path
        self.fields: tuple[str, ...] = FIELDS

    def collect(self) -> str:
        t0 = time.monotonic()
        rows, error = None, None
        if not self.exe:
            error = "not found on PATH"
        else:
            try:
                rows = query(self.exe, self.fields)
            except SmiError as exc:
                error = str(exc)
                # an older driver that does not know the throttle field: ask without it from now on
                if THROTTLE_FIELD in self.fields and "not a valid field" in error.lower():
                    self.fields = tuple(f for f in self.fields if f != THROTTLE_FIELD)
                    try:
                        rows, error = query(self.exe, self.fields), None
                    except SmiError as exc2:
                        error = str(exc2)
        return render(rows, meminfo(self.meminfo_path), error, time.monotonic() - t0)


class Handler(BaseHTTPRequestHandler):
    collector: Collector

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        return

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = self.collector.collect().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GB10 exporter (Prometheus text format)")
    p.add_argument("--listen", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=9835)
    p.add_argument("--nvidia-smi", default=None, help="nvidia-smi to run (default: the one on PATH)")
    p.add_argument("--meminfo", type=Path, default=MEMINFO)
    p.add_argument("--once", action="store_true", help="print one scrape and exit")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        print(f"gb10_exporter: --port {args.port} is out of range: give 1..65535", file=sys.stderr)
        return 2
    exe = args.nvidia_smi or shutil.which("nvidia-smi")
    collector = Collector(exe, args.meminfo)
    if args.once:
        text = collector.collect()
        sys.stdout.write(text)
        if "gb10_nvidia_smi_up 1.0" in text or "gb10_memory_available_bytes" in text:
            return 0
        print(f"gb10_exporter: read nothing: nvidia-smi ({exe or 'not on PATH'}) and {args.meminfo} "
              "both failed; "
              "give --nvidia-smi PATH or check the driver", file=sys.stderr)
        return 1
    Handler.collector = collector
    try:
        server = ThreadingHTTPServer((args.listen, args.port), Handler)
    except OSError as exc:
        print(f"gb10_exporter: cannot listen on {args.listen}:{args.port}: {exc}; "
              "free the port or give another with --port", file=sys.stderr)
        return 1
    print(f"gb10_exporter: serving http://{args.listen}:{args.port}/metrics "
          f"(nvidia-smi: {exe or 'not found'})", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
