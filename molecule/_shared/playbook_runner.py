"""Run the project's playbooks against a molecule instance from a testinfra verify step.

The negative cases of a scenario (bad input, a failing unit) are real ansible-playbook runs
against the same systemd test host, so they assert the messages users see.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]


@dataclass
class PlaybookResult:
    rc: int
    output: str


def run_playbook(playbook: str, extra_vars: dict | None = None, *, tags: str | None = None,
                 extra_args: list[str] | None = None, timeout: int = 900) -> PlaybookResult:
    """Run PROJECT/playbook against the molecule inventory; return rc and combined output."""
    inventory = os.environ["MOLECULE_INVENTORY_FILE"]
    env = dict(os.environ)
    env.update(
        ANSIBLE_CONFIG=str(PROJECT / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(PROJECT / "roles"),
        ANSIBLE_LIBRARY=str(PROJECT / "library"),
        ANSIBLE_MODULE_UTILS=str(PROJECT / "scripts"),
        ANSIBLE_FILTER_PLUGINS=str(PROJECT / "filter_plugins"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
    )
    cmd = ["ansible-playbook", "-i", inventory, str(PROJECT / playbook)]
    if extra_vars:
        cmd += ["-e", json.dumps(extra_vars)]
    if tags:
        cmd += ["--tags", tags]
    cmd += extra_args or []
    proc = subprocess.run(cmd, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    return PlaybookResult(proc.returncode, proc.stdout + proc.stderr)


def run_playbook_raw_e(playbook: str, raw_e: str, **kwargs) -> PlaybookResult:
    """Like run_playbook but with one `-e key=value` string, exactly as a user would type it."""
    return run_playbook(playbook, None, extra_args=["-e", raw_e] + kwargs.pop("extra_args", []), **kwargs)
