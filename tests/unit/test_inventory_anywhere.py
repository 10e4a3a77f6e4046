"""The toolkit's settings load for an inventory at any path; bad -e input is refused by validation.

Runs the real ansible-playbook against copies of the example inventories placed outside the
repository. Only the validation play (tagged ``always``) and the roles' argument-spec checks run: the
tag selects no task that would contact a host, so the ssh hosts of the examples are never reached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "inventory" / "examples"
NO_STAGE_TAG = "always"  # only the `always` plays run: validation, the cluster topology (no host contact)

pytestmark = pytest.mark.skipif(
    shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) is None
    and shutil.which("ansible-playbook") is None,
    reason="ansible-playbook not installed",
)


def ansible_playbook(inventory: Path, playbook: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    env["ANSIBLE_NOCOLOR"] = "1"
    env.pop("ANSIBLE_INVENTORY", None)
    return subprocess.run(
        ["ansible-playbook", "-i", str(inventory), playbook, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def outside_inventory(tmp_path: Path) -> Path:
    """A copy of the README's remote-Spark example, outside the repository (nothing next to it)."""
    inv = tmp_path / "elsewhere" / "my-spark.yml"
    inv.parent.mkdir()
    shutil.copy(EXAMPLES / "remote-spark.yml", inv)
    return inv


@pytest.mark.parametrize("example", ["remote-spark.yml", "two-sparks.yml"])
def test_site_validation_passes_with_an_inventory_outside_the_repo(tmp_path: Path, example: str) -> None:
    inv = tmp_path / example
    shutil.copy(EXAMPLES / example, inv)
    before = tree_digest(tmp_path)
    r = ansible_playbook(inv, "site.yml", "--tags", NO_STAGE_TAG, "-e", "spec_method=mtp")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "is undefined" not in out
    assert "Check spec_method and every serving knob against the method catalogue" in out
    assert tree_digest(tmp_path) == before  # validation wrote nothing next to the inventory


def test_stage_playbook_alone_finds_the_settings(outside_inventory: Path) -> None:
    r = ansible_playbook(outside_inventory, "playbooks/validate.yml", "-e", "spec_method=ngram")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


# An owner's own entry (spark_model_catalogue_local), the 35B's with its size unknown or a path as model_dir.
_SMALL = yaml.safe_load((ROOT / "group_vars/all/models.yml").read_text())["spark_model_catalogue"][
    "qwen3.6-35b-a3b-fp8"]
_MINE_UNSIZED = {**_SMALL, "model_dir": "mine",
                 "sizes": {"disk_bytes": {"checkpoint": None}, "memory_bytes": None}}
_MINE_BAD_DIR = {**_SMALL, "model_dir": "/srv/models/mine"}

# The playbook's rows of the bad-input table: (extra vars, what the one message must name).
BAD_E = [
    (["-e", "spec_method=bogus"], "spec_method='bogus' is not a known method"),
    (["-e", "model=bogus"], "model='bogus' is not in the model catalogue; set -e model= to one of"),
    (["-e", json.dumps({"model": "mine", "spark_model_catalogue_local": {"mine": _MINE_UNSIZED}})],
     "model=mine: its size on disk is unknown"),
    (["-e", json.dumps({"model": "mine", "spark_model_catalogue_local": {"mine": _MINE_BAD_DIR}})],
     "spark_model_catalogue.mine.model_dir='/srv/models/mine' must be a directory name"),
    (["-e", "model=qwen3.6-35b-a3b-fp8", "-e", "spec_method=dflash"], "it supports: baseline, ngram, mtp"),
    (["-e", "spec_method=eagle3"], "spec_eagle3_drafter"),
    (["-e", "bench_force=yes"], "bench_force must be a boolean"),
    (["-e", "spec_num_speculative_tokens=3"], "spec_num_speculative_tokens"),
    (["-e", "spec_methd=ngram"], "spec_methd is not a variable of this toolkit (did you mean spec_method?)"),
    (["-e", "vllm_gpu_memory_utilisation=0.8"], "(did you mean vllm_gpu_memory_utilization?)"),
    (["--tags", "serv"], "--tags serv: no play or task has this tag (did you mean serve?); the stage tags"),
    # knobs only the bench stage (the last) reads were refused only there (issue 46, 11)
    (["-e", "bench_repeats=0"], "bench_repeats=0 is out of range (0 passes measure nothing)"),
    (["-e", "bench_concurrency=1,,2"], "bench_concurrency='1,,2' has an empty item"),
    (["-e", "bench_concurrency=8"], "level 8 is above vllm_max_num_seqs=4"),
    (["-e", "bench_results_dir=/etc/hostname/results"], "bench_results_dir='/etc/hostname/results' cannot"),
    (["-e", '{"vllm_max_model_len": 10000000}'], "vllm_max_model_len=10000000 is above 262144"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD_E, ids=[e[1][:30] for e in BAD_E])
def test_bad_input_is_refused_before_any_host_is_touched(
    outside_inventory: Path, extra: list[str], needle: str
) -> None:
    before = tree_digest(outside_inventory.parent)
    r = ansible_playbook(outside_inventory, "site.yml", "--tags", NO_STAGE_TAG, *extra)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]  # ansible-playbook: a task failed
    assert needle in out, out[-3000:]
    assert "Traceback" not in out and "is undefined" not in out
    assert "UNREACHABLE" not in out  # refused in validation, before any connection
    assert tree_digest(outside_inventory.parent) == before


# An inventory that names no Spark: every play skipped "no hosts matched" and ansible-playbook exited 0
# having done nothing (issue 46, 10). The first play, on the controller, stops it with the fix.
@pytest.mark.parametrize("text", [None, "sparks:\n  hosts:\n    spark-01:\n      ansible_host: x.lan\n",
                                  "spark: [oops\n"], ids=["missing", "sparks", "not-yaml"])
def test_site_stops_in_validation_when_no_host_is_in_spark(tmp_path: Path, text: str | None) -> None:
    inv = tmp_path / "my-sparks.yml"
    if text is not None:
        inv.write_text(text)
    r = ansible_playbook(inv, "site.yml", "--tags", NO_STAGE_TAG, "-e", "spec_method=mtp")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "The inventory has no host in the group `spark`" in out, out[-3000:]
    assert "inventory/examples/" in out and "Traceback" not in out
