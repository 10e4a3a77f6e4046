"""What each release's Ray executor copies from the head onto its workers, asked of the release's own code.

vLLM copies the driver's (the head server's) variables with the prefixes NCCL_, UCX_, VLLM_, HF_ ...
onto every Ray worker (``vllm/ray/ray_env.py`` ``get_env_vars_to_copy``, used by
``v1/executor/ray_executor.py``), so a per-node setting like ``NCCL_SOCKET_IFNAME`` would reach the worker
with the head's value. The mechanism the releases honour: a JSON list of names read from
``VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json``. Our cluster stage writes every name of the head's
cluster file there (``spark_ray_env_exclude``) and the serve unit mounts it at the container's default
config root. These tests run the real function with and without the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spark_cluster import spark_ray_env_exclude

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
HEAD_ENV = """# Cluster environment of spark-a (as templates/cluster.env.j2 renders it)
GLOO_SOCKET_IFNAME=enp1s0f1np1
NCCL_DEBUG=INFO
NCCL_IB_DISABLE=0
NCCL_IB_HCA=rocep1s0f1
NCCL_SOCKET_IFNAME=enp1s0f1np1
RAY_memory_monitor_refresh_ms=0
TP_SOCKET_IFNAME=enp1s0f1np1
UCX_NET_DEVICES=enp1s0f1np1
VLLM_HOST_IP=192.168.100.10
"""
PROBE = """
import json, sys
from vllm.ray.ray_env import get_env_vars_to_copy
import vllm
print("RAY_ENV_PROBE", json.dumps({"version": vllm.__version__, "copied": sorted(get_env_vars_to_copy())}))
"""


def _copied(version: str, config_root: Path, installed: str) -> set[str]:
    paths = []
    if version != installed:
        overlay = ROOT / ".cache" / f"vllm-{version}-py"
        if not (overlay / ".complete").exists():
            pytest.skip(f"{overlay} is missing: run tests/contract/setup_vllm_env.sh")
        paths.append(str(overlay))
    head = dict(line.split("=", 1) for line in HEAD_ENV.splitlines() if line and not line.startswith("#"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "UCX_", "VLLM_", "HF_"))}
    env.update(head, NCCL_CROSS_NIC="1", VLLM_CONFIG_ROOT=str(config_root), PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RAY_ENV_PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1].split(" ", 1)[1])
    assert got["version"].split("+")[0] == version
    return set(got["copied"])


@pytest.mark.parametrize("version", ["0.19.1", "0.20.0", "0.26.0"])
def test_the_heads_link_settings_stay_on_the_head_only_with_our_list(vllm_module, tmp_path, version):
    installed = vllm_module.__version__.split("+")[0]
    names = spark_ray_env_exclude(HEAD_ENV)
    assert "NCCL_SOCKET_IFNAME" in names and "UCX_NET_DEVICES" in names and "NCCL_IB_HCA" in names
    # without the list the release copies the head's interface onto the workers: the problem is real
    bare = _copied(version, tmp_path / "empty", installed)
    assert {"NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES", "NCCL_IB_HCA"} <= bare
    # with it (what the cluster stage writes, where the serve unit mounts it) none of the node's names go
    root = tmp_path / "vllm-config"
    root.mkdir()
    (root / "ray_non_carry_over_env_vars.json").write_text(json.dumps(names))
    kept = _copied(version, root, installed)
    assert not kept & set(names), sorted(kept & set(names))
    # and the rest of the propagation still works (a head-wide NCCL setting not in the node's file)
    assert "NCCL_CROSS_NIC" in kept


def test_every_name_of_the_cluster_file_is_listed_once_sorted():
    assert spark_ray_env_exclude(HEAD_ENV + "\n# NCCL_FAKE=1\nNCCL_DEBUG=WARN\n") == sorted(
        {"GLOO_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME",
         "RAY_memory_monitor_refresh_ms", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES", "VLLM_HOST_IP"})
    with pytest.raises(ValueError):
        spark_ray_env_exclude(None)
