"""bench: what every part of ``bench.py`` shares: paths, the two error kinds, the clock, number
formatting (standard library only)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# the two error kinds (exit 2, exit 1) every bench module raises: sparkllm.cli's, re-exported
from ..cli import UsageError as UsageError
from ..cli import WorkFailed as WorkFailed

SCRIPTS_DIR = Path(__file__).resolve().parents[2]  # scripts/ (on the Spark: spark_tools_dir)
DEFAULT_PROMPTS = SCRIPTS_DIR / "prompts" / "prompts.jsonl"
SPECBENCH_MANIFEST = SCRIPTS_DIR / "prompts" / "specbench.json"
REPORT_DIRNAME = "report"  # the report's directory inside the store: DIR/report/report.md


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)
