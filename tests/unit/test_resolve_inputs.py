"""The inputs of the dry-run resolution (scripts/sparkllm/lock/resolve.py, run against PyPI by the
contract suite) are what the image really installs: the constraints file as the role renders it, the base
stage's and the runtime stage's `pip install` lines of the rendered Dockerfile. No network here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.unit.test_dockerfile import LOCKS, VARIANTS, constraints, rendered

ROOT = Path(__file__).resolve().parents[2]
from sparkllm.lock import resolve as rr  # noqa: E402


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_resolver_uses_the_constraints_file_the_role_writes(variant):
    lines = [line for line in constraints(variant).splitlines() if line.strip() and not line.startswith("#")]
    assert rr.constraints_lines(VARIANTS[variant]) == lines


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_resolver_installs_what_the_dockerfile_installs(variant):
    """The base stage installs the lock's base files (scripts/image_lock.py resolves them from the resolver's
    base names); the runtime stage proves the resolver's extras are met from what it installed."""
    text = rendered(variant)
    stage = text.split("FROM base AS build")[0]
    assert "pip install --no-deps --require-hashes -r /opt/sparkllm/lock/base.txt" in stage
    locked = {line.split("==")[0] for stem in ("base", "base-index")
              for line in (LOCKS / variant / f"{stem}.txt").read_text().splitlines() if "==" in line}
    assert set(rr.base_names(VARIANTS[variant])) <= locked
    runtime_stage = text.split("FROM base AS runtime")[1]
    runtime = re.search(r"pip install --no-index --dry-run (.*) \\", runtime_stage).group(1)
    assert runtime.split() == rr.RUNTIME_EXTRAS
    assert shlex.split(runtime) == [e.strip('"') for e in rr.RUNTIME_EXTRAS]
    if VARIANTS[variant].get("install") == "wheel":
        assert VARIANTS[variant]["wheel"]["url"] in text  # the wheel the runtime-wheel set resolves by URL


def test_public_pins_drop_only_the_local_label():
    assert rr.public_pins(["torch==2.10.0+cu130", "triton==3.6.0", "ray==2.60.0"]) == [
        "torch==2.10.0", "triton==3.6.0", "ray==2.60.0"]


def test_the_target_platforms_are_every_tag_glibc_239_aarch64_accepts():
    assert rr.PLATFORMS[0] == "manylinux_2_39_aarch64" and rr.PLATFORMS[-2:] == ["manylinux2014_aarch64",
                                                                                 "linux_aarch64"]
    assert "manylinux_2_28_aarch64" in rr.PLATFORMS and "manylinux_2_17_aarch64" in rr.PLATFORMS
    assert not [p for p in rr.PLATFORMS if not p.endswith("_aarch64")]
    assert (rr.TARGET_ENV["platform_machine"], rr.TARGET_ENV["python_version"]) == ("aarch64", "3.12")


def test_pip_settings_of_the_host_do_not_leak_in(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/host-constraints.txt")
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/certs/ca.crt")
    env = rr._pip_env()
    assert "PIP_FIND_LINKS" not in env and "PIP_CONSTRAINT" not in env
    assert env["PIP_CERT"] == "/etc/ssl/certs/ca.crt" and env["PIP_CONFIG_FILE"] == "/dev/null"
