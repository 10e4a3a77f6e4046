"""Behaviour of the cluster stage on two systemd test hosts linked by one Docker network."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from playbook_runner import PROJECT, run_playbook

HEAD_IP, WORKER_IP = "10.213.77.10", "10.213.77.11"
# the link port's name on each box (prepare.yml renames the worker's: the cable on different ports)
LINK = {"cluster-head": "eth0", "cluster-worker": "enp1s0f1np1"}
RAY = "/opt/sparkllm/ray-venv/bin/ray"
MODEL = "/srv/models/cluster-test"
TOKEN_FILE = "/var/lib/sparkllm/ray/auth-token"
# what every Ray client needs: Ray checks its token (roles/ray_cluster)
AUTH = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={TOKEN_FILE}"
# a clean environment for a Ray driver, with the token
DRIVER = f"env -i PATH=/usr/bin:/bin {AUTH} /opt/sparkllm/ray-venv/bin/python"


def _active_ray_nodes(head) -> int:
    out = head.check_output(f"{AUTH} {RAY} status --address {HEAD_IP}:6379")
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
    for node, ip, name in ((head, HEAD_IP, "cluster-head"), (worker, WORKER_IP, "cluster-worker")):
        iface = LINK[name]
        env = _env(node)
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES"):
            assert env[name] == iface
        # spark_cluster_rdma=false on the test bed: TCP said explicitly, no RoCE device named, no NCCL_DEBUG
        assert env["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in env and "NCCL_DEBUG" not in env
        assert env["VLLM_HOST_IP"] == ip
        assert env["RAY_memory_monitor_refresh_ms"] == "0"
        # the Ray process itself runs with that environment
        unit = "sparkllm-ray-head" if node is head else "sparkllm-ray-worker"
        pid = node.check_output(f"systemctl show -p MainPID --value {unit}")
        environ = node.check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ")
        assert f"NCCL_SOCKET_IFNAME={iface}" in environ and f"VLLM_HOST_IP={ip}" in environ


def test_the_gid_index_is_the_nodes_own_and_absent_where_empty(head, worker):
    """spark_link_nccl_ib_gid_index is 5 on the head (host_vars/cluster-head.yml) and "" on the worker: the
    head's cluster environment and Ray process carry NCCL_IB_GID_INDEX=5, the worker's have no such line (NCCL
    picks the GID itself), and the head's server keeps vLLM from copying its value onto the worker's ranks."""
    assert _env(head)["NCCL_IB_GID_INDEX"] == "5"
    assert "NCCL_IB_GID_INDEX" not in _env(worker)
    for node, unit, want in ((head, "sparkllm-ray-head", ["NCCL_IB_GID_INDEX=5"]),
                             (worker, "sparkllm-ray-worker", [])):
        pid = node.check_output(f"systemctl show -p MainPID --value {unit}")
        environ = node.check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ").splitlines()
        assert [v for v in environ if v.startswith("NCCL_IB_GID_INDEX=")] == want, unit
    names = json.loads(head.file("/etc/sparkllm/vllm-ray-env-exclude.json").content_string)
    assert "NCCL_IB_GID_INDEX" in names


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
        expected = f"{node}: link interface {LINK[node]} has MTU 9000, expected 9100"
        assert expected in result.output, result.output


# ------------------------------------------------------------------ access: keys and firewall

LAN_HEAD_IP = "10.213.78.10"  # the head on cluster-outside: a network that is not the link
SYNC_KEY = "/root/.ssh/sparkllm_model_sync"
SSH = (f"ssh -i {SYNC_KEY} -o BatchMode=yes -o StrictHostKeyChecking=accept-new "
       "-o UserKnownHostsFile=/root/.ssh/sparkllm_known_hosts")
IMAGE = "sparkllm-cluster-test/vllm:standin"
CONNECT = ("import socket,sys; s=socket.socket(); s.settimeout(3); "
           "sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)")


def _authorized_keys(head) -> str:
    f = head.file("/root/.ssh/authorized_keys")
    return f.content_string if f.exists else ""


def _outsider_connects(ip: str, port: int) -> bool:
    """A container on cluster-outside (not the link) opens a TCP connection to ip:port."""
    proc = subprocess.run(["docker", "run", "--rm", "--network", "cluster-outside", "spark-testhost:bookworm",
                           "python3", "-c", CONNECT, ip, str(port)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


def _drops(head) -> int:
    doc = json.loads(head.check_output("nft -j list table inet sparkllm"))
    rules = [item["rule"] for item in doc["nftables"] if "rule" in item]
    return sum(e["counter"]["packets"] for rule in rules for e in rule["expr"] if "counter" in e)


def _set_ports(node, name: str) -> set[int]:
    doc = json.loads(node.check_output(f"nft -j list set inet sparkllm {name}"))
    ports: set[int] = set()
    for item in next(i["set"] for i in doc["nftables"] if "set" in i)["elem"]:
        if isinstance(item, dict):
            lo, hi = item["range"]
            ports.update(range(lo, hi + 1))
        else:
            ports.add(item)
    return ports


def _firewalled_ports(node) -> set[int]:
    """Every port the link firewall closes: Ray's, the engine's and the exporters'."""
    names = ("ray_tcp_ports", "engine_tcp_ports", "exporter_tcp_ports")
    return set().union(*(_set_ports(node, n) for n in names))


def _listeners(node) -> list[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket."""
    out = []
    for line in node.check_output("ss -Htlnp").splitlines():
        fields = line.split()
        addr, port = fields[3].rsplit(":", 1)
        out.append((addr.strip("[]"), int(port), " ".join(fields[5:])))
    return out


def _wildcard_ray_port(head) -> int:
    """A firewalled port Ray listens on at every address (6379, the head's GCS, when it does)."""
    allowed = _set_ports(head, "ray_tcp_ports")
    ports = sorted({p for a, p, _ in _listeners(head) if a in ("0.0.0.0", "*", "::") and p in allowed})
    assert ports, "Ray listens on no firewalled port at every address: nothing for the outsider to try"
    return 6379 if 6379 in ports else ports[0]


def test_no_worker_key_left_on_the_head(head):
    assert "sparkllm model sync" not in _authorized_keys(head)


def test_sync_key_entry_allows_only_a_read_only_rsync_of_the_model(head, worker):
    """The entry the role writes during a copy (same filter), tried from the worker while it exists."""
    sys.path.insert(0, str(PROJECT / "filter_plugins"))
    from spark_cluster import spark_sync_key_options

    pub = worker.file(f"{SYNC_KEY}.pub").content_string.strip()
    options = spark_sync_key_options(WORKER_IP, ["/usr/bin/rrsync", "-ro", MODEL])
    before = _authorized_keys(head)
    head.check_output("install -d -m 0700 /root/.ssh && printf '%s\\n' " + shlex.quote(f"{options} {pub}")
                      + " >> /root/.ssh/authorized_keys")
    try:
        listing = worker.run(f"rsync --list-only --rsh '{SSH}' root@{HEAD_IP}:/")
        assert listing.rc == 0 and "config.json" in listing.stdout, listing.stderr
        shell = worker.run(f"{SSH} root@{HEAD_IP} id")
        assert shell.rc != 0 and "uid=" not in shell.stdout
        push = worker.run(f"rsync --rsh '{SSH}' /etc/hostname root@{HEAD_IP}:/pushed")
        assert push.rc != 0 and not head.file(f"{MODEL}/pushed").exists
        outside = worker.run(f"rsync --list-only --rsh '{SSH}' root@{HEAD_IP}:/../../../etc/")
        assert outside.rc != 0 or "shadow" not in outside.stdout
    finally:
        head.check_output("printf '%s' " + shlex.quote(before) + " > /root/.ssh/authorized_keys")


def test_ray_ports_answer_the_link_and_loopback_only(head, worker):
    port = _wildcard_ray_port(head)
    # the firewall, not the network, is what stops the outsider: sshd on the same address answers it
    assert _outsider_connects(LAN_HEAD_IP, 22)
    dropped = _drops(head)
    assert not _outsider_connects(LAN_HEAD_IP, port), port
    assert not _outsider_connects(LAN_HEAD_IP, 6381)
    assert _drops(head) > dropped
    for node, ip in ((worker, HEAD_IP), (head, "127.0.0.1"), (head, HEAD_IP)):
        assert node.run(f"python3 -c {shlex.quote(CONNECT)} {ip} {port}").rc == 0, (node, ip, port)


def test_every_port_ray_listens_on_is_firewalled(head, worker):
    """Every non-loopback TCP listener but sshd (i.e. Ray's) is in the firewall's port set."""
    for node in (head, worker):
        allowed = _firewalled_ports(node)
        stray = [f"{a}:{p} {procs}" for a, p, procs in _listeners(node)
                 if not (a.startswith("127.") or a == "::1" or '"sshd"' in procs) and p not in allowed]
        assert not stray, f"Ray listens beyond loopback on ports the firewall does not name: {stray}"
    # the firewall unit loads at boot and the Ray units start after it
    assert head.service("sparkllm-link-firewall.service").is_enabled


def test_failed_copy_leaves_no_key_on_the_head(head, worker, monkeypatch):
    """The head's sshd is down during a copy: the copy fails, the key entry is removed anyway; recovery."""
    monkeypatch.setenv("ANSIBLE_CALLBACK_RESULT_FORMAT", "json")
    worker.check_output("rm -f /etc/ansible/facts.d/spark_cluster.fact")
    head.check_output("systemctl stop ssh.service ssh.socket 2>/dev/null || systemctl stop ssh.service")
    try:
        failed = run_playbook("playbooks/cluster.yml")
        assert failed.rc != 0 and "Pull the checkpoint from the head" in failed.output, failed.output[-3000:]
        assert "Remove the worker's key from the head again" in failed.output
        assert "sparkllm model sync" not in _authorized_keys(head)
    finally:
        head.check_output("systemctl start ssh.service")
    recovered = run_playbook("playbooks/cluster.yml")
    assert recovered.rc == 0, recovered.output[-3000:]
    assert "sparkllm model sync" not in _authorized_keys(head)
    assert worker.file("/etc/ansible/facts.d/spark_cluster.fact").exists


def test_link_state_absent_removes_the_firewall_then_present_restores_it(head, worker):
    """absent: table, unit and files gone and Ray's port answers the outsider (the firewall was the block);
    present again (with a forced image copy): all back, the image reached the worker by ID."""
    port = _wildcard_ray_port(head)
    removed = run_playbook("playbooks/cluster.yml", {"spark_link_state": "absent"})
    assert removed.rc == 0, removed.output[-3000:]
    try:
        assert head.run("nft list table inet sparkllm").rc != 0
        for path in ("/etc/sparkllm/link-firewall.nft", "/etc/systemd/system/sparkllm-link-firewall.service",
                     "/etc/sparkllm/cluster.env", "/etc/netplan/40-sparkllm-link.yaml"):
            assert not head.file(path).exists, path
        assert _outsider_connects(LAN_HEAD_IP, port)
    finally:
        restored = run_playbook("playbooks/cluster.yml", {"ray_cluster_image_copy_force": True})
    assert restored.rc == 0, restored.output[-3000:]
    assert "Stream the image from the head into this worker's Docker engine" in restored.output
    assert not _outsider_connects(LAN_HEAD_IP, port)
    assert _env(worker)["VLLM_HOST_IP"] == WORKER_IP
    ids = {n.check_output(f"docker image inspect --format '{{{{.Id}}}}' {IMAGE}") for n in (head, worker)}
    assert len(ids) == 1 and next(iter(ids)).startswith("sha256:")
    assert "sparkllm model sync" not in _authorized_keys(head)
    assert _active_ray_nodes(head) == 2


# A Ray task placed on the worker node reports its own process environment: what vLLM's model ranks on that
# node would see (vLLM copies only its own prefixes to them: vllm/ray/ray_env.py, get_env_vars_to_copy).
_WORKER_ENV_SNIPPET = """
import json, os, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == sys.argv[2])
@ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
def probe(names):
    return {"ip": ray.util.get_node_ip_address(), "env": {k: os.environ.get(k) for k in names}}
print(json.dumps(ray.get(probe.remote(sys.argv[3:]), timeout=120)))
"""


def test_the_servers_environment_reaches_a_ray_worker_on_the_other_node(head, worker):
    names = ["SPARKLLM_LM_HEAD_INT8", "VLLM_USE_V2_MODEL_RUNNER", "SPARKLLM_TEST_OWNER_ENV",
             "CUDA_CACHE_MAXSIZE"]
    head.check_output(f"cat > /tmp/worker_env.py <<'EOF'\n{_WORKER_ENV_SNIPPET}EOF")
    # a clean driver environment: whatever the task reports comes from the worker node's Ray unit
    out = head.check_output(f"{DRIVER} /tmp/worker_env.py "
                            f"{HEAD_IP}:6379 {WORKER_IP} {' '.join(names)}")
    got = json.loads(out.strip().splitlines()[-1])
    assert got["ip"] == WORKER_IP
    assert got["env"] == {"SPARKLLM_LM_HEAD_INT8": "1", "VLLM_USE_V2_MODEL_RUNNER": "1",
                          "SPARKLLM_TEST_OWNER_ENV": "cluster", "CUDA_CACHE_MAXSIZE": "4294967296"}
    unit = worker.file("/etc/systemd/system/sparkllm-ray-worker.service").content_string
    assert "Environment=SPARKLLM_LM_HEAD_INT8=1" in unit


def test_each_node_keeps_its_own_link_settings_against_vllms_copy(head, worker):
    """vLLM copies the head server's NCCL_*/UCX_* onto every Ray worker unless they are listed in
    VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json (tests/contract/test_ray_env_contract.py asks each
    release). The head's list holds every name of its cluster file; a Ray task on the worker sees the worker's
    own interface, which differs from the head's here."""
    names = json.loads(head.file("/etc/sparkllm/vllm-ray-env-exclude.json").content_string)
    # and HF_TOKEN_PATH: each node's Ray unit names its own token file
    assert names == sorted([*_env(head), "HF_TOKEN_PATH"])
    assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES", "NCCL_IB_DISABLE"} <= set(names)
    assert not worker.file("/etc/sparkllm/vllm-ray-env-exclude.json").exists  # read by the head's server only
    head.check_output(f"cat > /tmp/worker_env.py <<'EOF'\n{_WORKER_ENV_SNIPPET}EOF")
    out = head.check_output(f"{DRIVER} /tmp/worker_env.py "
                            f"{HEAD_IP}:6379 {WORKER_IP} NCCL_SOCKET_IFNAME UCX_NET_DEVICES")
    got = json.loads(out.strip().splitlines()[-1])
    own = LINK["cluster-worker"]
    assert got["env"] == {"NCCL_SOCKET_IFNAME": own, "UCX_NET_DEVICES": own}
    assert _env(head)["NCCL_SOCKET_IFNAME"] != got["env"]["NCCL_SOCKET_IFNAME"]


def test_rdma_on_a_link_without_roce_is_refused_naming_the_interface(head, monkeypatch):
    """spark_cluster_rdma=true (the default) on the test hosts, which have no RoCE device: the link check
    fails before anything is written, naming the interface and the way out (NCCL would fall back to TCP)."""
    monkeypatch.setenv("ANSIBLE_CALLBACK_RESULT_FORMAT", "json")  # messages unwrapped
    before = head.file("/etc/sparkllm/cluster.env").content_string
    res = run_playbook("playbooks/cluster.yml", {"spark_cluster_rdma": True})
    assert res.rc != 0
    assert "link interface eth0 has no RoCE device (/sys/class/net/eth0/device/infiniband" in res.output
    assert "NCCL would fall back" in res.output and "spark_cluster_rdma=false" in res.output
    assert head.file("/etc/sparkllm/cluster.env").content_string == before


# ------------------------------------------------------------------ every Spark guarded and watched

HF_TOKEN = "hf_clustertest_not_a_real_token_5d1c"  # group_vars/spark.yml ray_cluster_hf_token
GUARD_LINES_KIB = (268435456 // 1024, 134217728 // 1024)  # group_vars/spark.yml, the budget's lines

# A Ray actor of vLLM's class name placed on the worker node: the process that holds the worker's GPU share in
# Ray mode (0.19.1 v1/executor/ray_executor.py: ray.remote(...)(RayWorkerWrapper)); prints its pid and comm.
_ACTOR_SNIPPET = """
import json, os, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == sys.argv[2])
class RayWorkerWrapper:
    def where(self):
        path = os.environ.get("HF_TOKEN_PATH")
        return {"pid": os.getpid(), "comm": open("/proc/self/comm").read().strip(),
                "ip": ray.util.get_node_ip_address(), "token_path": path,
                "token": open(path).read() if path else None}
on_worker = NodeAffinitySchedulingStrategy(node, soft=False)
Actor = ray.remote(num_cpus=0, scheduling_strategy=on_worker)(RayWorkerWrapper)
a = Actor.remote()
print(json.dumps(ray.get(a.where.remote(), timeout=120)))
"""


def _actor_on_worker(head) -> dict:
    head.check_output(f"cat > /tmp/actor.py <<'EOF'\n{_ACTOR_SNIPPET}EOF")
    out = head.check_output(f"{DRIVER} /tmp/actor.py "
                            f"{HEAD_IP}:6379 {WORKER_IP}")
    return json.loads(out.strip().splitlines()[-1])


def _earlyoom_argv(node) -> list[str]:
    pid = node.check_output("systemctl show -p MainPID --value earlyoom.service")
    return node.check_output(f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines()


def test_the_worker_is_guarded_at_the_budgets_lines_preferring_the_ray_actor(head, worker):
    """earlyoom runs on the worker with the memory budget's lines; its --prefer rule matches the comm of a
    real Ray actor of vLLM's RayWorkerWrapper class on that node, and not Ray's own daemons."""
    import re

    for node in (head, worker):
        assert node.service("earlyoom.service").is_running and node.service("earlyoom.service").is_enabled
    argv = _earlyoom_argv(worker)
    assert argv[argv.index("-M") + 1] == f"{GUARD_LINES_KIB[0]},{GUARD_LINES_KIB[1]}"
    prefer = re.compile(argv[argv.index("--prefer") + 1])
    got = _actor_on_worker(head)
    assert got["ip"] == WORKER_IP
    comm = got["comm"]  # /proc/self/comm of the actor's process while it runs a method on the worker
    print(f"RAY ACTOR COMM on the worker: {comm!r}")
    assert comm.startswith("ray::RayWorkerW") and prefer.search(comm), (comm, prefer.pattern)
    for daemon in ("raylet", "gcs_server"):
        assert not prefer.search(daemon)
    raylet = worker.check_output("pgrep -x raylet | head -1")
    assert not prefer.search(worker.file(f"/proc/{raylet}/comm").content_string.strip())
    # the hook stops the worker's Ray node after such a kill (its restart would take the actors back)
    hook = worker.file("/usr/local/libexec/sparkllm/oom-hook").content_string
    assert "systemctl stop --no-block sparkllm-ray-worker.service" in hook


def test_the_workers_watchdog_judges_its_ray_node(worker):
    timer = worker.service("sparkllm-watchdog.timer")
    assert timer.is_enabled and timer.is_running
    unit = worker.file("/etc/systemd/system/sparkllm-watchdog.service").content_string
    assert "--unit sparkllm-ray-worker.service --ray-node http://127.0.0.1:52365" in unit
    assert f"--ray-head {HEAD_IP}:6379" in unit and "--url" not in unit
    worker.check_output("systemctl start sparkllm-watchdog.service")
    state = json.loads(worker.file("/var/lib/sparkllm-ops/watchdog.json").content_string)
    assert state["last"]["kind"] == "ok" and "Ray node alive" in state["last"]["reason"], state
    assert state.get("failures", 0) == 0 and not state.get("ray_head")


def test_rays_directories_are_closed_to_other_local_users(head, worker):
    for node in (head, worker):
        top = node.file("/var/lib/sparkllm/ray")
        assert (top.user, top.group, top.mode) == ("root", "root", 0o700), node
        # Ray makes its session directory 0777 at every start: the closed parent is what keeps others out
        assert node.file("/var/lib/sparkllm/ray/tmp/session_latest").exists
        denied = node.run("setpriv --reuid=65534 --regid=65534 --clear-groups ls /var/lib/sparkllm/ray/tmp")
        assert denied.rc != 0 and "Permission denied" in denied.stderr, (node, denied.stdout)
        assert node.run("setpriv --reuid=65534 --regid=65534 --clear-groups ls /var/lib/sparkllm/ray/tmp/"
                        "session_latest/sockets").rc != 0


def test_the_dashboard_listens_on_loopback_only(head, worker):
    dash = [(a, p) for a, p, _ in _listeners(head) if p == 8265]
    assert dash and all(a in ("127.0.0.1", "::1") for a, _ in dash), dash
    assert head.run(f"python3 -c {shlex.quote(CONNECT)} 127.0.0.1 8265").rc == 0
    assert worker.run(f"python3 -c {shlex.quote(CONNECT)} {HEAD_IP} 8265").rc != 0
    assert not [(a, p) for a, p, _ in _listeners(worker) if p == 8265]


def test_the_firewall_names_the_engines_pinned_ports(head, worker):
    r"""VLLM_PORT (where vLLM's get_open_port scans from) and its range, the mp master port, the kernel's
    ephemeral range (NCCL and Gloo listen there) and the exporters' ports are in the ruleset of both nodes."""
    for node in (head, worker):
        assert _env(node)["VLLM_PORT"] == "29600"
        lo, hi = map(int, node.file("/proc/sys/net/ipv4/ip_local_port_range").content_string.split())
        engine = _set_ports(node, "engine_tcp_ports")
        assert set(range(29600, 29632)) | {29501} | set(range(lo, hi + 1)) <= engine
        assert {9100, 9835} <= _set_ports(node, "exporter_tcp_ports")
        ruleset = node.check_output("nft list table inet sparkllm")
        assert "ct state established,related accept" in ruleset
        # the live ruleset prints the counter's values: "counter packets N bytes M drop"
        drop = (r'tcp dport @engine_tcp_ports counter packets \d+ bytes \d+ drop '
                r'comment "engine port from outside')
        assert re.search(drop, ruleset), ruleset


_LISTEN = ("import socket,sys,time; s=socket.socket(); "
           "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
           "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(8); time.sleep(300)")


def test_engine_ports_answer_the_link_but_not_the_outside(head, worker):
    """A listener as torch.distributed's store (VLLM_PORT) and one as NCCL's or Gloo's (a port of the
    kernel's ephemeral range), on every address of the head: the worker reaches them over the link, a host
    outside does not."""
    lo, _ = map(int, head.file("/proc/sys/net/ipv4/ip_local_port_range").content_string.split())
    for port in (29600, lo + 777):
        head.check_output(f"systemd-run --unit sparkllm-test-listen-{port} "
                          f"python3 -c {shlex.quote(_LISTEN)} {port}")
        try:
            for _ in range(50):
                if any(p == port for _, p, _ in _listeners(head)):
                    break
                subprocess.run(["sleep", "0.2"], check=True)
            assert worker.run(f"python3 -c {shlex.quote(CONNECT)} {HEAD_IP} {port}").rc == 0, port
            assert not _outsider_connects(LAN_HEAD_IP, port), port
        finally:
            head.run(f"systemctl stop sparkllm-test-listen-{port}")


_GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def _get_json(node, url: str) -> dict:
    return json.loads(node.check_output(f"python3 -c {shlex.quote(_GET)} {shlex.quote(url)}"))


def test_the_heads_prometheus_scrapes_the_workers_exporters_over_the_link(head, worker):
    for port in (9100, 9835):
        listening = [a for a, p, _ in _listeners(worker) if p == port]
        assert listening == [WORKER_IP], (port, listening)  # the link address only
    doc = _get_json(head, "http://127.0.0.1:9090/api/v1/targets?state=active")
    targets = {(t["scrapePool"], t["labels"].get("node")): t for t in doc["data"]["activeTargets"]}
    for job, port in (("node", 9100), ("gb10", 9835)):
        t = targets[(job, "cluster-worker")]
        assert t["health"] == "up" and t["scrapeUrl"] == f"http://{WORKER_IP}:{port}/metrics", t
        assert targets[(job, "cluster-head")]["health"] == "up"
    from urllib.parse import quote

    q = _get_json(head, "http://127.0.0.1:9090/api/v1/query?query="
                  + quote('gb10_power_draw_watts{node="cluster-worker"}'))
    assert q["data"]["result"], q
    fact = json.loads(worker.file("/etc/ansible/facts.d/spark_monitoring.fact").content_string)
    assert fact["scraped_by"] == "cluster-head" and fact["prometheus_url"] is None
    assert not worker.service("prometheus.service").is_running


def test_the_dashboards_hardware_panels_show_each_spark(head):
    """The dashboard's node selector lists both Sparks (its own label_values query, run as Prometheus's
    series API does it), and every panel that filters on it returns one series per Spark with All selected."""
    from urllib.parse import quote

    dash = json.loads((PROJECT / "templates/grafana/dashboards/spark-serving.json").read_text())
    var = next(v for v in dash["templating"]["list"] if v["name"] == "node")
    match = re.fullmatch(r"label_values\((.+), node\)", var["query"]["query"])
    assert match, var
    got = _get_json(head, f"http://127.0.0.1:9090/api/v1/label/node/values?match[]={quote(match[1])}")
    assert got["data"] == ["cluster-head", "cluster-worker"], got
    sys.path.insert(0, str(PROJECT / "tests/harness"))
    import dashboard_queries

    per_node = [q for q in dashboard_queries.panel_queries(dash) if "$node" in q["expr"]]
    assert len(per_node) >= 6
    for q in per_node:
        expr = dashboard_queries.substitute(q["expr"], "20s", dashboard_queries.all_values(dash))
        res = _get_json(head, f"http://127.0.0.1:9090/api/v1/query?query={quote(expr)}")["data"]["result"]
        assert sorted(r["metric"].get("node") for r in res) == ["cluster-head", "cluster-worker"], (q, res)


def test_the_hf_token_reaches_the_workers_rank_as_a_file_and_nowhere_else(head, worker):
    f = worker.file("/var/lib/sparkllm/ray/hf-token")
    assert (f.user, f.mode) == ("root", 0o600)
    got = _actor_on_worker(head)
    # what the worker's rank of vLLM would read for the drafter's download (huggingface_hub: HF_TOKEN_PATH)
    assert got["token_path"] == "/var/lib/sparkllm/ray/hf-token" and got["token"] == HF_TOKEN
    for node, unit in ((head, "sparkllm-ray-head"), (worker, "sparkllm-ray-worker")):
        assert HF_TOKEN not in node.file(f"/etc/systemd/system/{unit}.service").content_string
        assert node.run(f"journalctl --no-pager -u {unit} | grep -c {HF_TOKEN}").stdout.strip() == "0"
        pid = node.check_output(f"systemctl show -p MainPID --value {unit}")
        assert HF_TOKEN not in node.check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ")


_HTTP_STATUS = """
import sys, urllib.error, urllib.request
req = urllib.request.Request(sys.argv[1], headers=dict(a.split("=", 1) for a in sys.argv[2:]))
try:
    print(urllib.request.urlopen(req, timeout=10).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


def test_ray_refuses_a_client_without_the_clusters_token(head, worker):
    """Ray's token authentication: the same token, root's only, on both nodes; a driver without it (another
    local user's, or one on the link) is refused by the GCS, the dashboard's job API answers 401 without it,
    and the node agent's health probe (the worker watchdog's) stays public, as Ray 2.60 exempts it."""
    files = [node.file(TOKEN_FILE) for node in (head, worker)]
    assert [(f.user, f.mode) for f in files] == [("root", 0o600)] * 2
    token = files[0].content_string.strip()
    assert len(token) >= 32 and files[1].content_string.strip() == token
    for node, unit in ((head, "sparkllm-ray-head"), (worker, "sparkllm-ray-worker")):
        assert token not in node.file(f"/etc/systemd/system/{unit}.service").content_string
        assert node.run(f"journalctl --no-pager -u {unit} | grep -c {token}").stdout.strip() == "0"
    status = f"timeout 60 {RAY} status --address {HEAD_IP}:6379"
    bare = "env -i PATH=/usr/bin:/bin HOME=/nonexistent"
    for env in (bare, f"{bare} RAY_AUTH_MODE=token RAY_AUTH_TOKEN=wrong-0123456789abcdef0123456789abcdef"):
        r = worker.run(f"{env} {status}")
        assert r.rc != 0 and "node_" not in r.stdout, (env, r.stdout, r.stderr)
    assert "node_" in worker.check_output(f"{AUTH} {status}")
    for node in (head, worker):
        node.check_output(f"cat > /tmp/http_status.py <<'EOF'\n{_HTTP_STATUS}EOF")
    jobs = "python3 /tmp/http_status.py http://127.0.0.1:8265/api/jobs/"
    assert head.check_output(jobs).strip() == "401"
    assert head.check_output(f"{jobs} 'Authorization=Bearer {token}'").strip() == "200"
    probe = "python3 /tmp/http_status.py http://127.0.0.1:52365/api/local_raylet_healthz"
    assert worker.check_output(probe).strip() == "200"
