"""Behaviour of the cluster stage on two systemd test hosts linked by one Docker network."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from playbook_runner import PROJECT, run_playbook

HEAD_IP, WORKER_IP = "10.213.77.10", "10.213.77.11"
RAY = "/opt/sparkllm/ray-venv/bin/ray"
MODEL = "/srv/models/cluster-test"


def _active_ray_nodes(head) -> int:
    out = head.check_output(f"{RAY} status --address {HEAD_IP}:6379")
    active = out.split("Active:", 1)[1].split("Pending:", 1)[0]
    return sum(1 for line in active.splitlines() if "node_" in line)


def _env(node) -> dict[str, str]:
    lines = node.file("/etc/sparkllm/cluster.env").content_string.splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_ray_status_lists_both_nodes(head):
    assert _active_ray_nodes(head) == 2


def test_ray_units_active_enabled_and_valid(head, worker):
    for node, unit in ((head, "sparkllm-ray-head.service"), (worker, "sparkllm-ray-worker.service")):
        service = node.service(unit)
        assert service.is_running and service.is_enabled
        verify = node.run(f"systemd-analyze verify /etc/systemd/system/{unit}")
        assert verify.rc == 0 and not (verify.stdout + verify.stderr).strip(), verify.stderr
    worker_unit = worker.file("/etc/systemd/system/sparkllm-ray-worker.service").content_string
    assert f"--address {HEAD_IP}:6379" in worker_unit
    assert "--head" not in worker_unit


def test_cluster_env_derived_from_the_link_interface(head, worker):
    for node, ip in ((head, HEAD_IP), (worker, WORKER_IP)):
        env = _env(node)
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES"):
            assert env[name] == "eth0"
        assert env["NCCL_IB_HCA"] == "rocep1s0f0,roceP2p1s0f0"
        assert env["VLLM_HOST_IP"] == ip
        assert env["RAY_memory_monitor_refresh_ms"] == "0"
        # the Ray process itself runs with that environment
        unit = "sparkllm-ray-head" if node is head else "sparkllm-ray-worker"
        pid = node.check_output(f"systemctl show -p MainPID --value {unit}")
        environ = node.check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ")
        assert "NCCL_SOCKET_IFNAME=eth0" in environ and f"VLLM_HOST_IP={ip}" in environ


def test_head_serve_arguments_span_both_nodes(head, worker):
    record = json.loads(head.file("/etc/sparkllm/cluster-serve.json").content_string)
    argv = record["serve_argv"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"
    assert "--nnodes" not in argv and "--headless" not in argv
    assert record["nodes"] == ["cluster-head", "cluster-worker"]
    assert record["head_address"] == f"{HEAD_IP}:6379"
    assert json.loads(worker.file("/etc/sparkllm/cluster-serve.json").content_string)["serve_argv"] is None


def test_jumbo_frames_pass_and_mtu_is_exact(head):
    assert head.run(f"ping -M do -s 8972 -c 2 -W 2 {WORKER_IP}").rc == 0
    # one byte more than the MTU must not pass unfragmented: the check above measures the real MTU
    assert head.run(f"ping -M do -s 8973 -c 1 -W 2 {WORKER_IP}").rc != 0


def test_netplan_file_rendered_for_the_twins(head):
    f = head.file("/etc/netplan/40-sparkllm-link.yaml")
    assert f.mode == 0o600
    text = f.content_string
    assert "eth0:" in text and "mtu: 9000" in text and f"addresses: [{HEAD_IP}/24]" in text


def test_checkpoint_copied_to_the_worker_and_verified(head, worker):
    manifest = json.loads(head.file(f"{MODEL}/sparkllm-manifest.json").content_string)
    for entry in manifest["files"]:
        assert worker.file(f"{MODEL}/{entry['name']}").sha256sum == entry["sha256"]
    fact = json.loads(worker.file("/etc/ansible/facts.d/spark_cluster.fact").content_string)
    assert fact["model_source"] == "cluster-head" and fact["model_files"] == len(manifest["files"])


def test_single_spark_inventory_is_a_no_op(tmp_path: Path):
    """The cluster stage against the single-node inventory touches nothing (check mode: no contact needed)."""
    cmd = ["ansible-playbook", "-i", str(PROJECT / "inventory" / "hosts.yml"),
           str(PROJECT / "playbooks" / "cluster.yml"), "--check"]
    proc = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "ANSIBLE_CONFIG": str(PROJECT / "ansible.cfg")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "changed=0" in proc.stdout and "spark_link" not in proc.stdout and "ray_cluster" not in proc.stdout


def test_stopped_worker_is_named_then_recovers(head, worker, monkeypatch):
    """Fault case: the worker's Ray unit stops -> the health check fails naming it; rerun -> recovered."""
    monkeypatch.setenv("ANSIBLE_CALLBACK_RESULT_FORMAT", "json")  # messages unwrapped
    started = "systemctl show -p ActiveEnterTimestampMonotonic --value sparkllm-ray-head"
    head_started = head.check_output(started)
    worker.check_output("systemctl stop sparkllm-ray-worker.service")
    try:
        failed = run_playbook("playbooks/cluster-health.yml",
                              {"ray_cluster_health_retries": 4, "ray_cluster_health_delay": 3})
        assert failed.rc != 0, failed.output
        missing = f"Missing: cluster-worker ({WORKER_IP}): not in the Ray cluster"
        assert missing in failed.output, failed.output
        assert "cluster-head (" not in failed.output.split("Missing:", 1)[1].split(".", 1)[0]
    finally:
        recovered = run_playbook("playbooks/cluster.yml")
    assert recovered.rc == 0, recovered.output
    assert worker.service("sparkllm-ray-worker.service").is_running
    assert _active_ray_nodes(head) == 2
    # recovering the worker did not restart the head
    assert head.check_output(started) == head_started


def test_wrong_link_mtu_is_named(monkeypatch):
    """The link check fails naming the node, the interface and both MTUs (read-only play, nothing changes)."""
    monkeypatch.setenv("ANSIBLE_CALLBACK_RESULT_FORMAT", "json")
    result = run_playbook("playbooks/cluster-health.yml", {"spark_link_mtu": 9100})
    assert result.rc != 0
    for node in ("cluster-head", "cluster-worker"):
        assert f"{node}: link interface eth0 has MTU 9000, expected 9100" in result.output, result.output
