"""nvidia-smi and /proc/meminfo readings (standard library only; runs on the Spark).

One home for what the benchmark's telemetry (``bench_telemetry``) and the GB10 exporter
(``scripts/gb10_exporter.py``) read from the GPU: ``nvidia-smi --query-gpu=FIELDS
--format=csv,noheader,nounits`` prints one line per GPU, one comma-separated value per field, and
GB10 prints ``[N/A]`` (or ``[Not Supported]``) for the fields NVML cannot report there, the
memory fields among them: GB10's memory is the host's, read from ``/proc/meminfo``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


class SmiError(RuntimeError):
    """nvidia-smi could not be run or printed something that is not its CSV answer."""


def num(s: str) -> float | None:
    """A numeric field, or None for [N/A], [Not Supported] and anything else not a number."""
    try:
        return float(s.strip())
    except ValueError:
        return None


def bitmask(s: str) -> int | None:
    """A hexadecimal bit mask field (clocks_throttle_reasons.active prints 0x0000000000000004)."""
    try:
        return int(s.strip(), 16)
    except ValueError:
        return None


def parse_query(out: str, fields: list[str] | tuple[str, ...]) -> list[dict[str, str]]:
    """The CSV answer of a --query-gpu call: one {field: raw text} per GPU line.

    A line with another number of values than fields asked for is refused (SmiError): a field
    name nvidia-smi does not know makes it print an error message instead of CSV."""
    rows = []
    for line in out.splitlines():
        if not line.strip():
            continue
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(fields):
            raise SmiError(f"nvidia-smi printed {line.strip()[:120]!r}, not {len(fields)} values")
        rows.append(dict(zip(fields, values, strict=True)))
    if not rows:
        raise SmiError("nvidia-smi printed no GPU line")
    return rows


def query(exe: str, fields: list[str] | tuple[str, ...], timeout: float = 10.0) -> list[dict[str, str]]:
    """Run nvidia-smi's --query-gpu for ``fields``; SmiError when it fails or answers something else."""
    try:
        proc = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SmiError(f"nvidia-smi timed out after {timeout:g} s") from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise SmiError(f"nvidia-smi failed: {exc}"[:200]) from exc
    if proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise SmiError(f"nvidia-smi exited {proc.returncode}: {(msg or [''])[0][:160]}")
    return parse_query(proc.stdout, fields)


def meminfo(path: Path = MEMINFO) -> dict[str, int]:
    """/proc/meminfo as {key: bytes} (its kB are KiB); {} when it cannot be read."""
    out: dict[str, int] = {}
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, ValueError):
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        out[key.strip()] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return out


def mem_available_mib(path: Path = MEMINFO) -> float | None:
    value = meminfo(path).get("MemAvailable")
    return value / 1048576.0 if value is not None else None
