"""Contract tests against the real vLLM package (marker ``vllm_contract``).

Run them with the interpreter of the contract environment::

    bash tests/contract/setup_vllm_env.sh          # once; idempotent
    .venv-vllm/bin/python -m pytest tests/contract -m vllm_contract

vLLM's platform is forced to its CPU platform here, before anything uses vLLM (this machine has
no GPU; detection would otherwise pick an unusable platform). Under an interpreter without vLLM
(the main .venv running ``pytest tests``) every test here is skipped with a reason that says how
to run them: they are never reported as passed there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

CONTRACT_DIR = Path(__file__).resolve().parent
ROOT = CONTRACT_DIR.parents[1]
EXPECTED_VLLM = "0.19.1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


if HAVE_VLLM:
    import vllm.platforms as _platforms
    from vllm.platforms.cpu import CpuPlatform as _CpuPlatform

    _platforms._current_platform = _CpuPlatform()


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(
        reason="vLLM is not installed in this interpreter; run "
        "`bash tests/contract/setup_vllm_env.sh && .venv-vllm/bin/python -m pytest tests/contract "
        "-m vllm_contract`"
    )
    for item in items:
        if CONTRACT_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_module():
    import vllm

    assert vllm.__version__ == EXPECTED_VLLM, (
        f"the contract environment has vllm {vllm.__version__}, expected {EXPECTED_VLLM}; "
        "rerun tests/contract/setup_vllm_env.sh"
    )
    return vllm


@pytest.fixture(scope="session")
def group_vars():
    base = ROOT / "group_vars" / "all"
    doc = yaml.safe_load((base / "methods.yml").read_text())
    doc.update(yaml.safe_load((base / "main.yml").read_text()))
    return doc


@pytest.fixture(scope="session")
def catalogue(group_vars):
    return group_vars["spark_method_catalogue"]


@pytest.fixture(scope="session")
def variants(group_vars):
    return group_vars["spark_vllm_variants"]
