#!/usr/bin/env python3
"""GB10 exporter: the Spark's GPU power, temperature, clocks and throttle reasons, and its unified
memory, in Prometheus' text format (standard library only; runs on the Spark).

    gb10_exporter.py [--listen 127.0.0.1] [--port 9835] [--nvidia-smi PATH] [--smi-timeout S]
                     [--meminfo PATH] [--ops-state-dir DIR]
    gb10_exporter.py --once        # print one scrape to stdout and exit (0 done, 1 nothing read)

Each scrape of ``/metrics`` runs ``nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits``
once (sparkllm.gpu_smi, the parser the benchmark's telemetry uses) and reads /proc/meminfo. A field
GB10 reports as [N/A] (memory.used and memory.total: NVML has no separate GPU memory there) is left
out, not exported as 0; the memory figures come from /proc/meminfo instead. Without nvidia-smi (or
when it fails, hangs past --smi-timeout, which the role keeps below Prometheus' scrape timeout, or
answers [N/A] for every field) the scrape still answers: ``gb10_nvidia_smi_up 0`` with
``gb10_nvidia_smi_error{reason=...} 1`` (not_found, timeout, failed, unparsable, all_na), and the
memory figures (``gb10_meminfo_up``). NaN and Inf are never exported.

The ops tools' state (role spark_ops, read from --ops-state-dir; files readable by other users):
  watchdog.json     ops_watchdog.py's state: {"restarts": [unix times within its window],
                    "gave_up": unix time or null, "failures": n, ...} -> sparkllm_watchdog_*
  guard-kills.log   one line appended per memory-guard kill: "<unix time> <pid> <name>"
                    (absent = no kill yet) -> sparkllm_guard_kills_total, ..._last_kill_timestamp_seconds
``sparkllm_ops_state_up{file=...}`` says whether each could be read.
Exit status: 0 done, 1 the listening socket could not be opened, 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparkllm.cli import UsageError, WorkFailed, doc_parser, run_main  # noqa: E402
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


OPS_STATE_DIR = Path("/var/lib/sparkllm-ops")
SMI_REASONS = ("not_found", "timeout", "failed", "unparsable", "all_na")


def _block(name: str, help_: str, samples: list[tuple[str, float]], kind: str = "gauge") -> list[str]:
    samples = [(labels, v) for labels, v in samples if math.isfinite(v)]  # NaN/Inf: left out
    if not samples:
        return []
    out = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    out += [f"{name}{labels} {_fmt(v)}" for labels, v in samples]
    return out


def smi_reason(error: str | None) -> str:
    """The reason label of a failed nvidia-smi call (SmiError's text)."""
    e = (error or "").lower()
    if "not found" in e or "no such file" in e:
        return "not_found"
    if "timed out" in e:
        return "timeout"
    if "printed" in e:
        return "unparsable"
    return "failed"


def render(smi_rows: list[dict[str, str]] | None, mem: dict[str, int], smi_error: str | None = None,
           duration_s: float | None = None, ops: list[str] | None = None) -> str:
    """The exposition text of one scrape (smi_rows None: nvidia-smi missing or failed)."""
    lines: list[str] = []
    gauges = []
    for field, metric, help_, scale in GAUGES:
        samples = []
        for i, row in enumerate(smi_rows or []):
            value = num(row.get(field, ""))
            if value is not None and math.isfinite(value):
                samples.append((f'{{gpu="{i}"}}', value * scale))
        gauges += _block(metric, help_, samples)
    masks = [(i, bitmask(row.get(THROTTLE_FIELD, ""))) for i, row in enumerate(smi_rows or [])]
    masks = [(i, m) for i, m in masks if m is not None]
    reason = None
    if smi_rows is None:
        reason = smi_reason(smi_error)
    elif not gauges and not masks:
        reason, smi_error = "all_na", "answered no number ([N/A] for every field)"
    lines += _block("gb10_nvidia_smi_up", "1 when nvidia-smi answered this scrape with at least one value.",
                    [("", 0.0 if reason else 1.0)])
    lines += _block("gb10_nvidia_smi_error", "1 for the reason nvidia-smi gave nothing this scrape "
                    "(not_found, timeout, failed, unparsable, all_na).",
                    [(f'{{reason="{reason}"}}', 1.0)] if reason else [])
    lines += gauges
    lines += _block("gb10_clocks_throttle_reasons_bitmask", "clocks_throttle_reasons.active as a number.",
                    [(f'{{gpu="{i}"}}', float(m)) for i, m in masks])
    lines += _block("gb10_clocks_throttle_reason_active", "1 when that throttle reason is active.",
                    [(f'{{gpu="{i}",reason="{name}"}}', 1.0 if m & bit else 0.0)
                     for i, m in masks for bit, name in THROTTLE_BITS])
    lines += _block("gb10_meminfo_up", "1 when /proc/meminfo gave MemTotal and MemAvailable.",
                    [("", 1.0 if "MemTotal" in mem and "MemAvailable" in mem else 0.0)])
    for key, metric, help_ in MEMINFO_GAUGES:
        if key in mem:
            lines += _block(metric, help_, [("", float(mem[key]))])
    lines += ops or []
    if duration_s is not None:
        lines += _block("gb10_scrape_duration_seconds", "Time this scrape took.", [("", duration_s)])
    if smi_error:
        lines.append(f"# nvidia-smi: {smi_error.replace(chr(10), ' ')[:200]}")
    return "\n".join(lines) + "\n"


def _finite(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def ops_metrics(state_dir: Path | None) -> list[str]:
    """sparkllm_watchdog_* from watchdog.json and sparkllm_guard_* from guard-kills.log (module doc)."""
    if state_dir is None:
        return []
    up: list[tuple[str, float]] = []
    lines: list[str] = []
    try:
        st = json.loads((state_dir / "watchdog.json").read_text(encoding="utf-8"))
        if not isinstance(st, dict):
            raise ValueError("not an object")
    except (OSError, ValueError):
        up.append(('{file="watchdog.json"}', 0.0))
    else:
        up.append(('{file="watchdog.json"}', 1.0))
        restarts = [t for t in (_finite(x) for x in st.get("restarts") or []) if t is not None]
        gave_up = _finite(st.get("gave_up"))
        lines += _block("sparkllm_watchdog_gave_up", "1 while the watchdog has given up.",
                        [("", 1.0 if gave_up else 0.0)])
        if gave_up:
            lines += _block("sparkllm_watchdog_gave_up_timestamp_seconds", "When the watchdog gave up.",
                            [("", gave_up)])
        lines += _block("sparkllm_watchdog_restarts_in_window", "Restarts by the watchdog within its window.",
                        [("", float(len(restarts)))])
        if restarts:
            lines += _block("sparkllm_watchdog_last_restart_timestamp_seconds", "Its last restart.",
                            [("", max(restarts))])
        failures = _finite(st.get("failures"))
        lines += _block("sparkllm_watchdog_failures", "Failed probes in a row.",
                        [("", failures)] if failures is not None else [])
    kills: list[float] = []
    try:
        text = (state_dir / "guard-kills.log").read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        readable = state_dir.is_dir()  # no kill yet
    except OSError:
        readable = False
    else:
        readable = True
        for line in text.splitlines():
            with contextlib.suppress(IndexError, ValueError):
                kills.append(float(line.split()[0]))
    up.append(('{file="guard-kills.log"}', 1.0 if readable else 0.0))
    if readable:
        lines += _block("sparkllm_guard_kills_total", "Memory-guard kills (guard-kills.log lines).",
                        [("", float(len(kills)))], kind="counter")
        last = [t for t in kills if math.isfinite(t)]
        if last:
            lines += _block("sparkllm_guard_last_kill_timestamp_seconds", "The memory guard's last kill.",
                            [("", max(last))])
    return _block("sparkllm_ops_state_up", "1 when that ops state file could be read (guard-kills.log: "
                  "absent counts as no kill).", up) + lines


class Collector:
    def __init__(self, exe: str | None, meminfo_path: Path = MEMINFO, smi_timeout: float = 5.0,
                 ops_state_dir: Path | None = None) -> None:
        self.exe = exe
        self.meminfo_path = meminfo_path
        self.smi_timeout = smi_timeout
        self.ops_state_dir = ops_state_dir
        self.fields: tuple[str, ...] = FIELDS

    def collect(self) -> str:
        t0 = time.monotonic()
        rows, error = None, None
        if not self.exe:
            error = "not found on PATH"
        else:
            try:
                rows = query(self.exe, self.fields, self.smi_timeout)
            except SmiError as exc:
                error = str(exc)
                # an older driver that does not know the throttle field: ask without it from now on
                if THROTTLE_FIELD in self.fields and "not a valid field" in error.lower():
                    self.fields = tuple(f for f in self.fields if f != THROTTLE_FIELD)
                    try:
                        rows, error = query(self.exe, self.fields, self.smi_timeout), None
                    except SmiError as exc2:
                        error = str(exc2)
        return render(rows, meminfo(self.meminfo_path), error, time.monotonic() - t0,
                      ops_metrics(self.ops_state_dir))


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


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("gb10_exporter.py", __doc__)
    p.add_argument("--listen", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=9835, help="port to listen on")
    p.add_argument("--nvidia-smi", default=None, help="nvidia-smi to run (default: the one on PATH)")
    p.add_argument("--smi-timeout", type=float, default=5.0,
                   help="seconds nvidia-smi may take (keep it below Prometheus' scrape timeout; default 5)")
    p.add_argument("--meminfo", type=Path, default=MEMINFO, help="the kernel's memory figures")
    p.add_argument("--ops-state-dir", type=Path, default=None,
                   help=f"the ops tools' state directory (e.g. {OPS_STATE_DIR}); default: not read")
    p.add_argument("--once", action="store_true", help="print one scrape and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main("gb10_exporter", lambda: export(args))


def export(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is out of range: give 1..65535")
    if not (math.isfinite(args.smi_timeout) and args.smi_timeout > 0):
        raise UsageError(f"--smi-timeout {args.smi_timeout} must be a positive number of seconds (below "
                         "Prometheus' scrape timeout)")
    exe = args.nvidia_smi or shutil.which("nvidia-smi")
    collector = Collector(exe, args.meminfo, args.smi_timeout, args.ops_state_dir)
    if args.once:
        text = collector.collect()
        sys.stdout.write(text)
        if "gb10_nvidia_smi_up 1.0" in text or "gb10_memory_available_bytes" in text:
            return 0
        raise WorkFailed(f"read nothing: nvidia-smi ({exe or 'not on PATH'}) and {args.meminfo} both "
                         "failed; give --nvidia-smi PATH or check the driver")
    Handler.collector = collector
    try:
        server = ThreadingHTTPServer((args.listen, args.port), Handler)
    except OSError as exc:
        raise WorkFailed(f"cannot listen on {args.listen}:{args.port}: {exc}; free the port or give "
                         "another with --port") from None
    print(f"gb10_exporter: serving http://{args.listen}:{args.port}/metrics "
          f"(nvidia-smi: {exe or 'not found'})", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
