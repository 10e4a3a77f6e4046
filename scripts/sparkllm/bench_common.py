"""bench: what every part of ``bench.py`` shares: paths, the two error kinds, the clock, number
formatting (standard library only)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCRIPTS_DIR = Path(__file__).resolve().parent.parent  # scripts/ (on the Spark: spark_tools_dir)
DEFAULT_PROMPTS = SCRIPTS_DIR / "prompts" / "prompts.jsonl"
SPECBENCH_MANIFEST = SCRIPTS_DIR / "prompts" / "specbench.json"
REPORT_DIRNAME = "report"  # the report's directory inside the store: DIR/report/report.md


class UsageError(Exception):
    """The command line is wrong (exit 2); the message names the problem and the fix."""


class WorkFailed(Exception):
    """The work was attempted and failed (exit 1); the message says why."""


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)
