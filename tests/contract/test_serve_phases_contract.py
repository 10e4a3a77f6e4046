"""Every load line of each release's model runners maps to a phase of the readiness tracker.

The serve role's readiness wait (scripts/sparkllm/serve_phases.py) times a start against the budget of
the phase its last line named. A load line it does not know leaves a slow weight load timed against the
engine phase's budget (issue 29: the V2 runner, which DFlash needs, logs ``Loading model from
scratch...``, not the V1 runner's ``Starting to load model``). This reads the ``logger.info*`` calls of
the ``load_model`` methods of both runners (V1 ``v1/worker/gpu_model_runner.py``, V2
``v1/worker/gpu/model_runner.py``) in 0.19.1 and 0.26.0 and classifies each message that speaks of
loading, with its ``%`` placeholders filled in as vLLM would.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from sparkllm.serve_phases import PHASES, classify

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
RELEASES = {
    "0.19.1": ROOT / ".venv-vllm" / "lib" / "python3.11" / "site-packages" / "vllm",
    "0.26.0": ROOT / ".cache" / "vllm-0.26.0-py" / "vllm",
}
RUNNERS = ("v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py")
LOAD_PHASES = {"weights", "compile"}  # "Model loading took ..." ends the load and opens the compile phase


def _load_messages(root: Path, rel: str, function: str = "load_model") -> list[str]:
    tree = ast.parse((root / rel).read_text())
    out = []
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == function):
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("info") and getattr(node.func.value, "id", "") == "logger"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                out.append(node.args[0].value)
    return out


def _as_logged(fmt: str) -> str:
    return re.sub(r"%(\.\d+)?[sdf]", lambda m: "0.25" if m.group(0).endswith("f") else "7", fmt)


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("runner", RUNNERS, ids=["v1", "v2"])
def test_every_load_line_of_the_runner_maps_to_a_load_phase(release, runner):
    root = RELEASES[release]
    if not (root / runner).is_file():
        pytest.fail(f"{root / runner} missing; run tests/contract/setup_vllm_env.sh")
    loads = [m for m in _load_messages(root, runner) if "load" in m.lower()]
    assert loads, f"no load line found in {runner} of {release}: the scan no longer sees the runner"
    unmapped = {m: classify(_as_logged(m)) for m in loads if classify(_as_logged(m)) not in LOAD_PHASES}
    assert not unmapped, f"{release} {runner}: load lines the tracker does not place: {unmapped}"


def test_the_v2_runner_s_first_load_line_opens_the_weights_phase():
    assert classify(_as_logged("Loading model from scratch...")) == "weights"
    assert [p for p, _, _ in PHASES].index("weights") > [p for p, _, _ in PHASES].index("engine")


# The phase lines of the runners: what each step of a start logs when it begins or ends, and the phase
# the tracker must be in after it (load_model opens "weights" and its "Model loading took" opens
# "compile"; capture_model's "Graph capturing finished" closes the capture).
PHASE_LINES = {"load_model": ("weights", "compile"), "capture_model": ("cuda_graphs",)}


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("runner", RUNNERS, ids=["v1", "v2"])
@pytest.mark.parametrize("function", PHASE_LINES)
def test_every_phase_line_of_the_runner_maps_to_its_phase(release, runner, function):
    root = RELEASES[release]
    if not (root / runner).is_file():
        pytest.fail(f"{root / runner} missing; run tests/contract/setup_vllm_env.sh")
    placed = {m: classify(_as_logged(m)) for m in _load_messages(root, runner, function)}
    phases = {p for p in placed.values() if p is not None}
    assert phases == set(PHASE_LINES[function]), (
        f"{release} {runner} {function}: the tracker places its lines in {phases}, expected "
        f"{PHASE_LINES[function]} (every line: {placed})")
