"""Issue 45: PYTORCH_CUDA_ALLOC_CONF in the server's environment (spark_pytorch_cuda_alloc_conf,
group_vars/all/memory.yml), checked against each release's own source.

- Neither release sets the variable itself: what the server's environment says is what PyTorch gets.
- Both only read it, and only to keep expandable_segments:True away from the CuMem (sleep-mode) pool:
  0.19.1 refuses it there, 0.26.0 turns it off around that pool.
- vLLM copies no PYTORCH_ variable to Ray's workers (vllm/ray/ray_env.py), so the Ray units set it too.
- expandable_segments:False is PyTorch's own default (the torch that 0.19.1's environment holds).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / ".venv-vllm" / "lib" / "python3.11" / "site-packages"
RELEASES = {
    "0.19.1": SITE / "vllm",
    "0.26.0": ROOT / ".cache" / "vllm-0.26.0-py" / "vllm",
}
NAME = "PYTORCH_CUDA_ALLOC_CONF"
# an assignment into the process environment: os.environ[NAME] = ..., environ.setdefault(NAME, ...), putenv
_SETS = re.compile(rf"""environ\[\s*["']{NAME}["']\s*\]\s*=(?!=)"""
                   rf"""|setdefault\(\s*["']{NAME}|putenv\(\s*["']{NAME}""")


def _release(release: str) -> Path:
    d = RELEASES[release]
    if not (d / "device_allocator").is_dir():
        pytest.fail(f"{d} missing; run tests/contract/setup_vllm_env.sh (and link .cache/vllm-0.26.0-py)")
    return d


def _sources(d: Path):
    for path in sorted(d.rglob("*.py")):
        if "tests" not in path.relative_to(d).parts:
            yield path, path.read_text(encoding="utf-8", errors="replace")


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_release_never_sets_the_allocator_variable(release: str) -> None:
    # the pattern finds the ways a module could set it
    for line in (f'os.environ["{NAME}"] = "x"', f"os.environ.setdefault('{NAME}', 'x')",
                 f'os.putenv("{NAME}", "")'):
        assert _SETS.search(line), line
    assert not _SETS.search(f'conf = os.environ.get("{NAME}", "")')
    d = _release(release)
    readers, setters = [], []
    for path, text in _sources(d):
        if NAME in text:
            rel = path.relative_to(d).as_posix()
            readers.append(rel)
            setters += [f"{rel}:{text[:m.start()].count(chr(10)) + 1}" for m in _SETS.finditer(text)]
    assert not setters, f"vLLM {release} sets {NAME} itself ({setters}): revisit memory.yml's knob"
    # it is read where the CuMem pool is made: the reason expandable_segments:True is kept away
    assert "device_allocator/cumem.py" in readers
    cumem = (d / "device_allocator" / "cumem.py").read_text(encoding="utf-8")
    refuses = '"expandable_segments:True" not in conf' in cumem
    turns_off = ('"expandable_segments:True" in conf' in cumem
                 and '_set_allocator_settings("expandable_segments:False")' in cumem)
    assert refuses or turns_off


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_ray_copies_no_pytorch_variable_to_its_workers(release: str) -> None:
    tree = ast.parse((_release(release) / "ray" / "ray_env.py").read_text(encoding="utf-8"))
    sets = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            sets[node.target.id] = ast.literal_eval(node.value)
    prefixes, extra = sets["DEFAULT_ENV_VAR_PREFIXES"], sets["DEFAULT_EXTRA_ENV_VARS"]
    assert "VLLM_" in prefixes  # the list is the one we think it is
    assert not any(NAME.startswith(p) for p in prefixes) and NAME not in extra


def test_the_shipped_value_is_pytorchs_default() -> None:
    memory = yaml.safe_load((ROOT / "group_vars/all/memory.yml").read_text())
    shipped = memory["spark_pytorch_cuda_alloc_conf"]
    assert shipped == "expandable_segments:False"
    header = SITE / "torch" / "include" / "c10" / "core" / "AllocatorConfig.h"
    assert "use_expandable_segments_{false}" in header.read_text(encoding="utf-8")
