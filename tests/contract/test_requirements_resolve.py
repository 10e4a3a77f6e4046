"""Issue 22 item 1: what each variant's image installs resolves for Linux aarch64 / CPython 3.12 under its
constraints file, by pip's own resolver (dry run, binary wheels only, the target's platform tags and marker
environment; scripts/sparkllm/lock/resolve.py). A missing aarch64 wheel or a conflict fails here, not
on a Spark an hour into a build.

The results are cached per machine (~/.cache/sparkllm/pip-resolve/) by the sha256 of every input
(setup_vllm_env.sh fills the cache); a cold run asks PyPI (HTTP range reads of each wheel's METADATA,
about a minute per set).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from sparkllm.lock import resolve as rr

from tests.unit import wheel_peek  # METADATA of a wheel on PyPI by HTTP ranges, cached in .cache/wheel-peek

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = rr.variants()
SETS = [(v, s) for v in sorted(VARIANTS)
        for s in ("build", "runtime-source", *(["runtime-wheel"] if VARIANTS[v].get("install") == "wheel"
                                               else []))]


def _resolve(variant: str, set_name: str, **kw) -> dict:
    try:
        r = rr.resolve(variant, set_name, **kw)
    except RuntimeError as exc:
        pytest.fail(f"{exc}; rerun tests/contract/setup_vllm_env.sh with PyPI reachable")
    needs_index = rr.uses_torch_index(rr.constraints_lines(VARIANTS[variant]))  # a +cu130 pin
    if needs_index and not r["mode"]["torch_index_reachable"]:
        warnings.warn(f"{r['mode']['torch_index']} unreachable: torch, torchvision, torchaudio resolved from "
                      "PyPI at their public versions", stacklevel=2)
    return r


def _public(version: str) -> str:
    return Version(version).public


@pytest.mark.parametrize(("variant", "set_name"), SETS)
def test_every_install_set_resolves_for_aarch64_py312(variant, set_name):
    r = _resolve(variant, set_name)
    assert r["ok"], f"{variant}/{set_name} does not resolve for aarch64 / CPython 3.12:\n{r['error'][-2000:]}"
    # the markers were evaluated for the target, not for the machine running pip
    assert (r["environment"]["platform_machine"], r["environment"]["python_version"]) == ("aarch64", "3.12")
    toolchain = VARIANTS[variant]["toolchain"]
    expected = rr.base_names(VARIANTS[variant]) if set_name == "build" else [*toolchain, "ray"]
    pins = {**toolchain, "ray": rr.ray_version()}
    got = {n: r["install"].get(n.lower()) for n in expected}
    assert got == {n: _public(str(pins[n])) for n in expected}, (
        f"{variant}/{set_name}: a pin of the toolchain is not what pip installs (or not installed at all)")


def test_markers_are_those_of_the_target():
    """vLLM 0.26.0 wants setuptools<81 for python_version > "3.11"; torch 2.10.0 on aarch64 pulls no CUDA 12
    libraries (its nvidia-*-cu12 lines are x86_64 only): both hold only with the target's markers."""
    r26 = _resolve("v0_26_dflash", "runtime-wheel")
    assert Version(r26["install"]["setuptools"]) < Version("81"), r26["install"]["setuptools"]
    r19 = _resolve("v0_19_1", "runtime-source")
    try:
        torch = [Requirement(r) for r in wheel_peek.requires_dist("torch", "2.10.0")]
    except wheel_peek.Offline as exc:
        pytest.fail(f"cannot read the torch 2.10.0 aarch64 wheel METADATA: {exc}")
    x86_only = {(r.name, str(r.specifier)[2:]) for r in torch
                if r.marker and "x86_64" in str(r.marker) and r.name != "triton"}  # triton: our own pin
    assert len(x86_only) > 10  # nvidia-*-cu12 and cuda-bindings 12.9.4
    assert not [(n, v) for n, v in x86_only if r19["install"].get(n.lower()) == v], x86_only


def test_an_unsatisfiable_pin_fails():
    """transformers 4.x against vLLM 0.26.0's transformers>=5.5.3: pip's conflict, reported."""
    r = _resolve("v0_26_dflash", "runtime-wheel", pins={"transformers": "4.57.6"})
    assert not r["ok"]
    assert "ResolutionImpossible" in r["error"], r["error"][-1500:]
    assert re.search(r"transformers==4\.57\.6|transformers>=5\.5\.3", r["error"]), r["error"][-1500:]


def test_a_pin_without_an_aarch64_wheel_fails():
    """triton 3.4.0 is on PyPI for x86_64 only (3.5.0 is its first aarch64 wheel)."""
    r = _resolve("v0_19_1", "build", pins={"triton": "3.4.0"})
    assert not r["ok"]
    assert "triton==3.4.0" in r["error"] and "ResolutionImpossible" in r["error"], r["error"][-1500:]
    assert re.search(r"no matching distributions available for your environment:\s+triton", r["error"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_setup_py_reading_matches_the_released_wheel(variant):
    """Our reading of setup.py's get_requirements() (the source build's Requires-Dist) on the release's sdist
    gives the Requires-Dist of the wheel vLLM published for that release (without extras)."""
    version = VARIANTS[variant]["version"]
    try:
        published = wheel_peek.requires_dist("vllm", version)
    except wheel_peek.Offline as exc:
        pytest.fail(f"cannot read the vllm {version} wheel METADATA: {exc}")
    core = sorted(str(Requirement(r)) for r in published if "extra ==" not in r)
    ours = sorted(str(Requirement(r)) for r in rr.setup_py_requirements(version))
    assert ours == core
