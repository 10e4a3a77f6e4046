"""Each vLLM build variant's toolchain (spark_vllm_variants.<variant>.toolchain, written to the variant's
constraints file that every image build stage installs under) against that vLLM release's own
requirements: the Requires-Dist lines of its wheel's METADATA on PyPI (read through HTTP ranges, cached
under .cache/wheel-peek/). triton is checked against the METADATA of the torch release pinned.

Needs PyPI (CI has it); offline it skips, naming the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from tests.unit import wheel_peek

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = yaml.safe_load((ROOT / "group_vars" / "all" / "methods.yml").read_text())["spark_vllm_variants"]
# what every toolchain pins (the ABI-relevant stack and the packages the issue names)
REQUIRED = {"torch", "torchvision", "torchaudio", "triton", "flashinfer-python", "transformers",
            "fastsafetensors"}
LINUX_AARCH64 = {"platform_system": "Linux", "platform_machine": "aarch64", "sys_platform": "linux",
                 "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                 "platform_python_implementation": "CPython", "os_name": "posix"}


def _requires(name: str, version: str) -> list[Requirement]:
    try:
        return [Requirement(r) for r in wheel_peek.requires_dist(name, version)]
    except wheel_peek.Offline as exc:
        pytest.skip(f"PyPI unreachable, cannot read the {name} {version} METADATA: {exc}")


def _applies(req: Requirement, extras: tuple[str, ...] = ("",)) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**LINUX_AARCH64, "extra": e}) for e in extras)


def _public(version: str) -> Version:
    return Version(Version(version).public)  # 2.10.0+cu130 -> 2.10.0: the local part names the CUDA build


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_toolchain_pins_every_package_exactly(variant):
    toolchain = VARIANTS[variant]["toolchain"]
    assert set(toolchain) >= REQUIRED, f"{variant} toolchain lacks {sorted(REQUIRED - set(toolchain))}"
    for version in toolchain.values():
        Version(str(version))  # an exact version, not a range
    # the CUDA 13 builds: all three +cu130 (the PyTorch index) or all three public (PyPI's wheels are that
    # build: test_a_public_torch_pin_is_pypi_s_cuda_13_build)
    labels = {Version(str(toolchain[name])).local for name in ("torch", "torchvision", "torchaudio")}
    assert labels in ({"cu130"}, {None}), f"{variant}: torch, torchvision, torchaudio: one CUDA 13 build"


def _pypi_build(name: str, version: str) -> str:
    """The version PyPI's aarch64 wheel of name==version reports in its own version.py: the local label is
    the build (2.11.0+cu130 for torch 2.11.0, 2.10.0+cpu for torch 2.10.0; METADATA has the public one)."""
    member = f"{name}/version.py"
    try:
        text = wheel_peek.read_members(name, version, [member])[member]
    except wheel_peek.Offline as exc:
        pytest.skip(f"PyPI unreachable, cannot read {member} of {name} {version}: {exc}")
    found = re.search(r"^__version__ = '([^']+)'", text, re.M)
    assert found, f"{name} {version}: no __version__ in {member}"
    return found.group(1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", ["torch", "torchvision", "torchaudio"])
def test_a_public_torch_pin_is_pypi_s_cuda_13_build(variant, name):
    """A public pin is installed from PyPI (scripts/image_lock.py, no PyTorch index): PyPI's aarch64 wheel
    must then be the cu130 build. A +cu130 pin goes to the PyTorch index because PyPI's is not."""
    pinned = Version(str(VARIANTS[variant]["toolchain"][name]))
    build = Version(_pypi_build(name, pinned.public))
    said = f"{variant}: PyPI's aarch64 {name} {pinned.public} is {build}"
    if pinned.local is None:
        assert build.local == "cu130", f"{said}, not the cu130 build: pin {name} +cu130 (the PyTorch index)"
    else:
        assert build.local != "cu130", f"{said}: pin the public version and lock it from PyPI"
    if name == "torch" and pinned.local is None:  # and its CUDA libraries are CUDA 13's
        cuda = [r for r in _requires("torch", pinned.public) if r.name.startswith(("cuda-toolkit", "nvidia-"))
                and _applies(r)]
        assert cuda and all(r.specifier.contains("13.0.2") if r.name == "cuda-toolkit"
                            else r.name.endswith("-cu13") for r in cuda), cuda


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_toolchain_satisfies_the_release_metadata(variant):
    conf = VARIANTS[variant]
    toolchain = conf["toolchain"]
    reqs = _requires("vllm", conf["version"])
    named = {}
    for req in reqs:
        if _applies(req, ("", "fastsafetensors")):
            named.setdefault(req.name.lower(), []).append(req)
    wrong = []
    for name, version in toolchain.items():
        for req in named.get(name.lower(), []):
            if not req.specifier.contains(_public(str(version)), prereleases=True):
                wrong.append(f"{name}=={version} but vLLM {conf['version']} requires {req}")
    assert not wrong, f"{variant}: " + "; ".join(wrong)
    # the release must name what we pin for it (a pin of a package vLLM dropped is a stale toolchain)
    for name in ("torch", "torchvision", "flashinfer-python", "transformers"):
        assert name in named, (f"vLLM {conf['version']} no longer requires {name}; "
                               f"revisit {variant}'s toolchain")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_triton_is_the_one_the_torch_release_requires(variant):
    toolchain = VARIANTS[variant]["toolchain"]
    torch = str(_public(str(toolchain["torch"])))
    tritons = [r for r in _requires("torch", torch) if r.name == "triton" and _applies(r)]
    if not tritons:  # this torch's aarch64 wheel on PyPI does not name triton; the x86_64 line does
        tritons = [r for r in _requires("torch", torch) if r.name == "triton"]
    assert tritons, f"torch {torch} names no triton"
    for req in tritons:
        assert req.specifier.contains(toolchain["triton"]), (
            f"{variant}: triton=={toolchain['triton']}, torch {torch} needs {req}")


def test_the_metadata_check_catches_a_wrong_pin(monkeypatch):
    """The check is real: torch 2.10.0 for vLLM 0.20.0 (which requires 2.11.0) is reported."""
    reqs = _requires("vllm", "0.20.0")
    torch = next(r for r in reqs if r.name == "torch" and _applies(r))
    assert not torch.specifier.contains(_public("2.10.0+cu130"))
    assert torch.specifier.contains(_public("2.11.0+cu130"))


def test_transformers_is_5_for_intels_tokenizer():
    for variant, conf in VARIANTS.items():
        assert Version(conf["toolchain"]["transformers"]).major == 5, variant
