"""Multi-node serve arguments as the cluster stage renders them, checked by vLLM 0.19.1's own parser.

The settings come from the real playbook: playbooks/cluster.yml derives the tensor-parallel size,
backend, node ranks and master address from an inventory (inventory/examples/two-sparks.yml, and a
three-node variant of it); the serve filter renders argv; vLLM parses it and builds its
ParallelConfig. ansible-playbook must be on PATH (the project's tool environment).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from spark_methods import spark_serve_argv

from tests.contract import vllm_probe

pytestmark = pytest.mark.vllm_contract

CONTRACT_DIR = Path(__file__).resolve().parent
ROOT = CONTRACT_DIR.parents[1]
EXAMPLE = ROOT / "inventory" / "examples" / "two-sparks.yml"
ANSIBLE_PLAYBOOK = os.environ.get("SPARKLLM_ANSIBLE_PLAYBOOK") or shutil.which("ansible-playbook")


def _three_sparks(tmp_path: Path) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc = copy.deepcopy(doc)
    doc["spark"]["children"]["spark_workers"]["hosts"]["spark-03"] = {
        "ansible_host": "spark-03.lan", "spark_link_addresses": ["192.168.100.12/24", "192.168.101.12/24"]}
    inventory_dir = tmp_path / "inventory"
    inventory_dir.mkdir()
    (inventory_dir / "group_vars").symlink_to(ROOT / "group_vars")
    path = inventory_dir / "three-sparks.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def derived_settings(inventory: Path, tmp_path: Path, extra: dict | None = None) -> dict[str, dict]:
    """Every node's serve settings after the cluster stage's topology play, by inventory host name."""
    if not ANSIBLE_PLAYBOOK:
        pytest.skip("ansible-playbook is not on PATH (set SPARKLLM_ANSIBLE_PLAYBOOK or add it to PATH)")
    dump = tmp_path / "settings.json"
    cmd = [ANSIBLE_PLAYBOOK, "-i", str(inventory), str(CONTRACT_DIR / "cluster_topology_dump.yml"),
           "--tags", "always", "-e", json.dumps({"dump_file": str(dump), "ansible_connection": "local",
                                                 "ansible_become": False, **(extra or {})})]
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(dump.read_text())


def parsed(settings: dict, catalogue: dict) -> tuple[list[str], dict]:
    argv = spark_serve_argv(settings, catalogue)
    result = vllm_probe.parse_serve(argv)
    assert result["ok"], f"vllm serve rejected {argv}: {result.get('stderr')}"
    return argv, result["args"]


@pytest.mark.parametrize("method", ["baseline", "mtp", "ngram"])
def test_two_sparks_ray_head_argv(vllm_module, catalogue, tmp_path, method):
    nodes = derived_settings(EXAMPLE, tmp_path, {"spec_method": method})
    assert list(nodes) == ["spark-01", "spark-02"]
    argv, args = parsed(nodes["spark-01"], catalogue)
    assert args["tensor_parallel_size"] == 2
    assert args["distributed_executor_backend"] == "ray"
    assert args["executor_backend_known"] is True
    assert args["nnodes"] == 1 and args["node_rank"] == 0 and args["headless"] is False
    # vLLM accepted everything up to importing Ray, which the contract environment does not install
    assert args["parallel_config"] == "needs_ray"
    assert "--nnodes" not in argv


def test_three_sparks_derive_tp3(vllm_module, catalogue, tmp_path):
    nodes = derived_settings(_three_sparks(tmp_path), tmp_path)
    _, args = parsed(nodes["spark-01"], catalogue)
    assert args["tensor_parallel_size"] == 3
    assert args["distributed_executor_backend"] == "ray"


def test_explicit_tp_is_kept(vllm_module, catalogue, tmp_path):
    nodes = derived_settings(EXAMPLE, tmp_path, {"spark_tensor_parallel_size": 4})
    _, args = parsed(nodes["spark-01"], catalogue)
    assert args["tensor_parallel_size"] == 4


def test_two_sparks_mp_backend_head_and_headless_worker(vllm_module, catalogue, tmp_path):
    nodes = derived_settings(EXAMPLE, tmp_path, {"spark_distributed_backend": "mp"})
    head_argv, head = parsed(nodes["spark-01"], catalogue)
    worker_argv, worker = parsed(nodes["spark-02"], catalogue)
    for args in (head, worker):
        assert args["distributed_executor_backend"] == "mp"
        assert args["tensor_parallel_size"] == 2
        assert args["nnodes"] == 2
        # the head's address on the NCCL interface, from the inventory
        assert args["master_addr"] == "192.168.100.10"
        assert args["parallel_config"] == "ok", args["parallel_config"]
        assert args["parallel_world_size"] == 2
    assert head["node_rank"] == 0 and head["headless"] is False
    assert worker["node_rank"] == 1 and worker["headless"] is True
    assert "--headless" in worker_argv and "--headless" not in head_argv


def test_single_spark_inventory_stays_single_node(vllm_module, catalogue, tmp_path):
    nodes = derived_settings(ROOT / "inventory" / "hosts.yml", tmp_path)
    argv, args = parsed(nodes["localhost"], catalogue)
    assert args["tensor_parallel_size"] == 1
    assert args["distributed_executor_backend"] is None
    assert "--tensor-parallel-size" not in argv and "--distributed-executor-backend" not in argv
