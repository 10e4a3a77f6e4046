"""model_fetch's state.yml, run by ansible-playbook on the controller (local connection, nothing
outside a temp dir): a recorded commit is what the tool is told to read, until model_fetch_update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK_BIN = Path(sys.executable).parent / "ansible-playbook"
SHA_A = "a" * 40


def run_state(tmp_path: Path, fact: dict, **extra: object) -> dict:
    facts = tmp_path / "facts"
    facts.mkdir(exist_ok=True)
    (facts / "spark_model.fact").write_text(json.dumps(fact))
    out = tmp_path / "state.json"
    play = tmp_path / "play.yml"
    play.write_text(
        f"""
- hosts: localhost
  connection: local
  gather_facts: false
  vars_files:
    - {ROOT}/group_vars/all/storage.yml
    - {ROOT}/group_vars/all/model.yml
    - {ROOT}/group_vars/all/models.yml
    - {ROOT}/group_vars/all/main.yml
    - {ROOT}/roles/spark_tools/defaults/main.yml
    - {ROOT}/roles/model_fetch/defaults/main.yml
  tasks:
    - ansible.builtin.include_tasks: {ROOT}/roles/model_fetch/tasks/state.yml
    - ansible.builtin.copy:
        dest: {out}
        content: "{{{{ {{'items': _model_fetch_items, 'todo': _model_fetch_todo}} | to_json }}}}"
        mode: "0644"
"""
    )
    extra_vars = {
        "model_fetch_facts_dir": str(facts),
        "model_fetch_int4_dir": str(tmp_path / "int4"),
        "model_fetch_fp8_dir": str(tmp_path / "fp8"),
        "ansible_python_interpreter": sys.executable,
        **extra,
    }
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_FILTER_PLUGINS": str(ROOT / "filter_plugins"),
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"), "ANSIBLE_REMOTE_TEMP": str(tmp_path / "tmp")}
    res = subprocess.run(
        [str(PLAYBOOK_BIN), "-i", "localhost,", str(play), "-e", json.dumps(extra_vars)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    return json.loads(out.read_text())


def _revision(item: dict) -> str:
    return item["argv"][item["argv"].index("--revision") + 1]


@pytest.mark.skipif(not PLAYBOOK_BIN.exists(), reason="ansible-playbook not in this venv")
def test_a_recorded_commit_is_read_until_an_update_is_asked_for(tmp_path: Path) -> None:
    first = run_state(tmp_path, {})
    assert [_revision(i) for i in first["items"]] == ["main", "main"]  # the tool resolves the branch

    lock = {"revisions": {"int4": {"repo": "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "requested": "main",
                                   "commit": SHA_A}}}
    locked = run_state(tmp_path, lock)
    int4, fp8 = locked["items"]
    assert _revision(int4) == SHA_A and _revision(fp8) == "main"  # only int4 has a recorded commit
    assert int4["source"].endswith("@main")  # the source names what was asked for
    assert not int4["refresh"]

    update = run_state(tmp_path, lock, model_fetch_update=True)
    int4 = update["items"][0]
    assert _revision(int4) == "main" and int4["refresh"]
    assert [t["key"] for t in update["todo"]] == ["int4", "fp8"]

    pinned = run_state(tmp_path, lock, model_fetch_update=True, model_fetch_int4_revision="b" * 40)
    assert _revision(pinned["items"][0]) == "b" * 40 and not pinned["items"][0]["refresh"]
