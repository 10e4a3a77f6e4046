"""The vLLM versions our patches are held to, and where each one's pristine package is.

0.19.1 is the vLLM installed in .venv-vllm; every other version is the pure-Python part of its wheel,
extracted by tests/contract/setup_vllm_env.sh into .cache/vllm-<version>-py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ["0.19.1", "0.20.0", "0.26.0"]


@dataclass(frozen=True)
class VllmTarget:
    """One vLLM version: where its pristine package is, and which patch dir belongs to it."""

    version: str
    package: Path  # the pristine `vllm` package directory
    installed: bool  # True: the one .venv-vllm imports by default

    @property
    def parent(self) -> Path:
        return self.package.parent

    @property
    def patch_dir(self) -> Path:
        return ROOT / "patches" / f"vllm-{self.version}"

    @property
    def probe_parent(self) -> Path | None:
        """--vllm-parent for a probe of the pristine package (None: the installed one)."""
        return None if self.installed else self.parent


def vllm_target(version: str, vllm_module, cls: type[VllmTarget] = VllmTarget) -> VllmTarget:
    """The target of ``version``; skips the test when its overlay has not been extracted."""
    if version == vllm_module.__version__:
        return cls(version, Path(vllm_module.__file__).resolve().parent, installed=True)
    overlay = ROOT / ".cache" / f"vllm-{version}-py"
    if not (overlay / ".complete").exists():
        pytest.skip(f"{overlay} is missing: run tests/contract/setup_vllm_env.sh (it extracts the "
                    f"pure-Python part of the vLLM {version} wheel)")
    return cls(version, (overlay / "vllm").resolve(), installed=False)
