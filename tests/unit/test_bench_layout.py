"""The shape of bench.py's package: the run side stays standard library only (it runs on the Spark
with the system python3), the report side is imported only by ``report``, and no module grows past
800 lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.standin_server import Config, StandinServer
from tests.unit.bench_helpers import write_prompts

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
MAX_LINES = 800
RUN_SIDE = ("bench.common", "bench.prompts", "bench.prometheus", "bench.stats", "bench.client",
            "bench.runner", "bench.store", "bench.cli", "bench.rate", "bench.depth", "bench.telemetry")

# Runs in a fresh interpreter: every import of a module outside the standard library (and our own
# bench / sparkllm) fails and is recorded, as on a Spark whose python3 has no matplotlib or rich.
DRIVER = r"""
import importlib, json, runpy, sys

# "org": the standard library's own probe for Jython (copy.py, 3.11), absent everywhere else
ALLOWED = set(sys.stdlib_module_names) | {"sparkllm", "bench", "org"}
attempts = []

class Blocker:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in ALLOWED:
            attempts.append(name)
            raise ImportError(f"blocked for the test: {name}")
        return None

sys.meta_path.insert(0, Blocker())
before = set(sys.modules)
blocker_works = False
try:
    import matplotlib  # noqa: F401  (installed in the toolkit's venv: the blocker must stop it)
except ImportError:
    blocker_works = True
attempts.clear()
for m in RUN_SIDE:
    importlib.import_module("sparkllm." + m)
sys.argv = ["bench.py", *ARGV]
try:
    runpy.run_path(SCRIPT, run_name="__main__")
    rc = 0
except SystemExit as exc:
    rc = exc.code
new = sorted(m for m in set(sys.modules) - before
             if m.partition(".")[0] not in ALLOWED)
print(json.dumps({"rc": rc, "blocker_works": blocker_works, "attempts": attempts, "third_party": new,
                  "report_loaded": "sparkllm.bench.report" in sys.modules}))
"""


RATE_RUN = ["--request-rate", "20", "--num-requests", "4", "--goodput", "ttft=2s"]


@pytest.mark.parametrize("load", [[], RATE_RUN], ids=["closed-loop", "request-rate"])
def test_run_side_is_stdlib_only_and_never_loads_the_report(tmp_path: Path, load: list[str]) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "results"
    with StandinServer(Config(step_time=0.001, model="m")) as srv:
        argv = ["run", "--base-url", srv.base_url, "--model", "m", "--label", "layout", "--out", str(out),
                "--prompts", str(prompts), "--warmup", "1", "--max-tokens", "6", *load]
        code = (DRIVER.replace("RUN_SIDE", repr(RUN_SIDE)).replace("ARGV", repr(argv))
                .replace("SCRIPT", repr(str(SCRIPTS / "bench.py"))))
        r = subprocess.run([sys.executable, "-s", "-c", code], capture_output=True, text=True, timeout=120,
                           env={"PYTHONPATH": str(SCRIPTS), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["blocker_works"], got
    assert got["rc"] == 0, r.stdout + r.stderr  # a valid run, written and stored
    assert got["attempts"] == [] and got["third_party"] == [], got
    assert got["report_loaded"] is False, got
    assert len(list(out.glob("*.json"))) == 1 and (out / "results.sqlite").is_file()


def test_no_python_module_over_800_lines() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for d in ("scripts", "library", "filter_plugins", "tests") for p in (ROOT / d).rglob("*.py")}
    assert "scripts/sparkllm/bench/runner.py" in sizes and "scripts/bench.py" in sizes  # it looked
    too_big = {k: v for k, v in sizes.items() if v > MAX_LINES}
    assert not too_big, f"split these modules (limit {MAX_LINES} lines): {too_big}"
