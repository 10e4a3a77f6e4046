"""Unit tests for filter_plugins/spark_cluster.py: Ray's pinned ports, the link's networks, the
restricted options of a worker's key on the head; and the link firewall's nftables template."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from spark_cluster import (
    RAY_FIXED_PORTS,
    FilterModule,
    spark_link_networks,
    spark_ray_firewall_ports,
    spark_ray_port_args,
    spark_sync_key_options,
)

from tests.unit.test_templates import render

ROOT = Path(__file__).resolve().parents[2]
PORTS = yaml.safe_load((ROOT / "group_vars" / "all" / "cluster.yml").read_text())["spark_ray_ports"]


def _opt(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_head_pins_every_port_and_workers_only_their_own():
    head = spark_ray_port_args(PORTS, True)
    worker = spark_ray_port_args(PORTS, False)
    assert _opt(head, "--port") == "6379" and _opt(head, "--ray-client-server-port") == "10001"
    assert _opt(head, "--dashboard-port") == "8265"
    for args in (head, worker):
        for option in ("--node-manager-port", "--object-manager-port", "--runtime-env-agent-port",
                       "--dashboard-agent-grpc-port", "--dashboard-agent-listen-port",
                       "--metrics-export-port"):
            assert _opt(args, option) is not None, option
        assert (_opt(args, "--min-worker-port"), _opt(args, "--max-worker-port")) == ("10002", "19999")
    assert "--port" not in worker and "--ray-client-server-port" not in worker
    assert len(head) % 2 == 0 and all(a.startswith("--") for a in head[::2])


def test_firewall_ports_cover_every_pinned_port_and_the_fixed_ones():
    elements = spark_ray_firewall_ports(PORTS)
    covered: set[int] = set()
    for e in elements:
        lo, _, hi = e.partition("-")
        covered.update(range(int(lo), int(hi or lo) + 1))
    pinned = spark_ray_port_args(PORTS, True)
    assert {int(v) for v in pinned[1::2]} <= covered
    assert set(RAY_FIXED_PORTS.values()) <= covered
    assert "10002-19999" in elements and 22 not in covered and 8000 not in covered


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gcs": 80}, "between 1024 and 65535"),
        ({"gcs": "six"}, "between 1024 and 65535"),
        ({"node_manager": 6379}, "both use port 6379"),
        ({"node_manager": 10500}, "lies in the worker range"),
        ({"min_worker": 20000}, "above max_worker"),
        ({"extra": 7000}, "unknown names ['extra']"),
    ],
)
def test_bad_ports_name_the_problem(change, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spark_ray_port_args({**PORTS, **change}, True)


def test_missing_port_is_named():
    ports = {k: v for k, v in PORTS.items() if k != "metrics_export"}
    with pytest.raises(ValueError, match=r"missing names \['metrics_export'\]"):
        spark_ray_firewall_ports(ports)


def test_link_networks_from_addresses():
    assert spark_link_networks(["192.168.100.1/24", "192.168.101.1/24", "192.168.100.2/24"]) == [
        "192.168.100.0/24", "192.168.101.0/24"]
    assert spark_link_networks(["10.213.77.10/30"]) == ["10.213.77.8/30"]


@pytest.mark.parametrize(
    "bad", [["10.0.0.1"], ["0.0.0.0/0"], ["fd00::1/64"], ["not-an-ip/24"], [], "10.0.0.1/24"]
)
def test_link_networks_refuse_what_would_open_or_mean_nothing(bad):
    with pytest.raises(ValueError):
        spark_link_networks(bad)


def test_sync_key_options_restrict_source_and_command():
    opts = spark_sync_key_options("192.168.100.2", ["/usr/bin/rrsync", "-ro", "/srv/models/q"])
    assert opts == 'restrict,from="192.168.100.2",command="/usr/bin/rrsync -ro /srv/models/q"'


@pytest.mark.parametrize(
    ("ip", "command"),
    [
        ("192.168.100.2", ["/usr/bin/rrsync", "-ro", '/srv/x",permitopen="*"']),  # widening the options
        ("192.168.100.2", ["/usr/bin/docker", "save", "img; rm -rf /"]),
        ("192.168.100.2", ["/usr/bin/rrsync", "-ro", "/srv/model dir"]),
        ("192.168.100.2", []),
        ("192.168.100.2", "/usr/bin/rrsync -ro /srv"),
        ('1.2.3.4",command="sh', ["/usr/bin/rrsync", "-ro", "/srv"]),
        ("*", ["/usr/bin/rrsync", "-ro", "/srv"]),
    ],
)
def test_sync_key_options_refuse_anything_that_could_widen_the_entry(ip, command):
    with pytest.raises(ValueError):
        spark_sync_key_options(ip, command)


def test_filters_registered():
    assert set(FilterModule().filters()) == {"spark_ray_port_args", "spark_ray_firewall_ports",
                                             "spark_link_networks", "spark_sync_key_options",
                                             "spark_nccl_transport", "spark_link_roce_hcas",
                                             "spark_ray_env_exclude"}


def _firewall(nets: list[str], engine: list[str] | None = None) -> str:
    sets = {"ray_tcp_ports": spark_ray_firewall_ports(PORTS),
            "engine_tcp_ports": ["29600-29631", "29501", "32768-60999"] if engine is None else engine,
            "exporter_tcp_ports": ["9100", "9835"]}
    return render("sparkllm-link-firewall.nft.j2", inventory_hostname="spark-a",
                  _spark_link_fw_table="sparkllm", _spark_link_fw_unit="sparkllm-link-firewall.service",
                  _spark_link_fw_sets=sets, _spark_link_fw_nets=nets)


def test_firewall_drops_new_connections_to_named_ports_from_outside_the_link():
    text = _firewall(["192.168.100.0/24", "192.168.101.0/24"])
    rules = [line.strip() for line in text.split("chain input {", 1)[1].splitlines() if line.strip()]
    assert rules[0] == "type filter hook input priority filter; policy accept;"
    # loopback and the link first, then replies to this node's own connections (their local ports are
    # ephemeral, a range the engine's set names); the drops name the sets' TCP ports only
    assert rules[1:4] == ['iifname "lo" accept', "ip saddr @link_nets accept",
                          "ct state established,related accept"]
    drop = 'tcp dport @{}_tcp_ports counter drop comment "{} port from outside the link"'
    assert rules[4:7] == [drop.format(name, what)
                          for name, what in (("ray", "Ray"), ("engine", "engine"), ("exporter", "exporter"))]
    assert sum("drop" in r for r in rules) == 3
    assert "elements = { 192.168.100.0/24, 192.168.101.0/24 }" in text
    assert "elements = { 6379, 6380," in text and "10002-19999" in text
    assert "elements = { 29600-29631, 29501, 32768-60999 }" in text
    # reloading replaces the table in one transaction
    assert text.index("delete table inet sparkllm") < text.index("table inet sparkllm {")
    # an empty set is left out with its rule (nft refuses an empty elements list)
    assert "engine_tcp_ports" not in _firewall(["10.0.0.0/24"], engine=[])


def test_the_engine_port_range_starts_at_vllm_port_of_the_cluster_environment():
    """VLLM_PORT is where vLLM's get_open_port() scans from: the firewall's engine range must start there."""
    link = yaml.safe_load((ROOT / "roles" / "spark_link" / "vars" / "main.yml").read_text())
    cluster = yaml.safe_load((ROOT / "group_vars" / "all" / "cluster.yml").read_text())
    assert "'VLLM_PORT': spark_vllm_dist_port" in link["_spark_link_env"]
    assert "_spark_link_dist_first ~ '-'" in link["_spark_link_engine_ports"]
    assert cluster["spark_vllm_dist_port"] == 29600 and cluster["spark_vllm_dist_port_count"] >= 8
    ray = set()
    for e in spark_ray_firewall_ports(cluster["spark_ray_ports"]):
        lo, _, hi = e.partition("-")
        ray |= set(range(int(lo), int(hi or lo) + 1))
    first = cluster["spark_vllm_dist_port"]
    assert not ray & set(range(first, first + cluster["spark_vllm_dist_port_count"]))


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft not installed")
def test_firewall_file_parses_with_nft(tmp_path):
    path = tmp_path / "fw.nft"
    path.write_text(_firewall(["10.0.0.0/24"]))
    proc = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr:
        pytest.skip("nft -c needs CAP_NET_ADMIN")
    assert proc.returncode == 0, proc.stderr


# ---- spark_nccl_transport: NCCL's own INFO lines (NCCL_DEBUG=INFO), as a server's journal carries them

_HEAD = "spark-a:2201:2390 [0] NCCL INFO "
_WORKER = "(RayWorkerWrapper pid=812, ip=192.168.100.11) spark-b:812:901 [1] NCCL INFO "
IB_LOG = "\n".join([
    _HEAD + "NCCL_IB_HCA set to rocep1s0f1,roceP2p1s0f1",
    _HEAD + "NET/IB : Using [0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE [RO]; "
            "OOB enp1s0f1np1:192.168.100.10<0>",
    _HEAD + "Using network IB",
    _WORKER + "NET/IB : Using [0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE [RO]; "
              "OOB enp1s0f1np1:192.168.100.11<0>",
    _WORKER + "Using network IB",
    _HEAD + "Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0",
])
SOCKET_LOG = "\n".join([
    _HEAD + "Failed to open libibverbs.so[.1]",
    _HEAD + "NET/Socket : Using [0]enp1s0f1np1:192.168.100.10<0>",
    _HEAD + "Using network Socket",
    _WORKER + "NET/IB : No device found.",
    _WORKER + "Using network Socket",
])


def test_nccl_over_roce_is_accepted_with_its_devices():
    from spark_cluster import spark_nccl_transport
    res = spark_nccl_transport(IB_LOG, "rocep1s0f1,roceP2p1s0f1")
    assert res["ok"] is True and res["transport"] == "IB"
    assert res["devices"] == ["rocep1s0f1:1/RoCE", "roceP2p1s0f1:1/RoCE"]
    assert "rocep1s0f1:1/RoCE" in res["reason"] and "2 communicators" in res["reason"]


def test_nccl_socket_fallback_is_refused_with_the_reasons_the_log_gives():
    from spark_cluster import spark_nccl_transport
    res = spark_nccl_transport(SOCKET_LOG, ["rocep1s0f1"])
    assert res["ok"] is False and res["transport"] == "Socket"
    assert res["reason"].startswith("NCCL fell back to TCP sockets over [0]enp1s0f1np1:192.168.100.10<0>")
    assert "RDMA user libraries" in res["reason"] and "templates/Dockerfile.j2" in res["reason"]
    assert "/dev/infiniband is not in the container" in res["reason"]
    assert "NCCL_IB_HCA=rocep1s0f1" in res["reason"]


def test_one_rank_on_sockets_is_enough_to_fail():
    from spark_cluster import spark_nccl_transport
    mixed = IB_LOG.replace(_WORKER + "Using network IB", _WORKER + "Using network Socket")
    res = spark_nccl_transport(mixed, "rocep1s0f1,roceP2p1s0f1")
    assert res["ok"] is False and "1 of 2 communicators" in res["reason"]
    assert "names no cause" in res["reason"] and "NCCL_IB_DISABLE=0" in res["reason"]


def test_nccl_on_a_device_that_is_not_the_link_is_refused():
    from spark_cluster import spark_nccl_transport
    res = spark_nccl_transport(IB_LOG.replace("roceP2p1s0f1:1", "mlx5_4:1"), "rocep1s0f1,roceP2p1s0f1")
    assert res["ok"] is False and "mlx5_4:1/RoCE" in res["reason"]
    assert "not the link's RoCE devices" in res["reason"]


def test_a_log_without_nccl_lines_names_nccl_debug():
    from spark_cluster import FilterModule, spark_nccl_transport
    res = spark_nccl_transport("INFO 12-01 vLLM API server started\n", "rocep1s0f1")
    assert res["ok"] is False and res["transport"] == "none" and "NCCL_DEBUG=INFO" in res["reason"]
    assert FilterModule().filters()["spark_nccl_transport"] is spark_nccl_transport


# ---- spark_link_roce_hcas: NCCL_IB_HCA from the link interfaces' RoCE devices (find results of sysfs)


def _find(iface, *devs):
    return {"item": iface, "matched": len(devs),
            "files": [{"path": f"/sys/class/net/{iface}/device/infiniband/{d}"} for d in devs]}


SPARK_LINK = [_find("enp1s0f1np1", "rocep1s0f1"), _find("enP2p1s0f1np1", "roceP2p1s0f1")]


def test_hcas_are_derived_from_every_link_interface():
    from spark_cluster import spark_link_roce_hcas
    res = spark_link_roce_hcas(SPARK_LINK, [], "enp1s0f1np1")
    assert res["error"] == "" and res["hcas"] == ["rocep1s0f1", "roceP2p1s0f1"]
    assert res["by_iface"] == {"enp1s0f1np1": ["rocep1s0f1"], "enP2p1s0f1np1": ["roceP2p1s0f1"]}


def test_an_interface_without_a_roce_device_is_named():
    from spark_cluster import spark_link_roce_hcas
    res = spark_link_roce_hcas([_find("eth0")], [], "eth0")
    assert "link interface eth0 has no RoCE device (/sys/class/net/eth0/device/infiniband" in res["error"]


@pytest.mark.parametrize("explicit, fragment", [
    (["rocep1s0f0"], "names rocep1s0f0, which is not a RoCE device of the link"),   # the other port's device
    (["roceP2p1s0f1"], "does not name the RoCE device of the NCCL interface enp1s0f1np1"),
])
def test_an_explicit_list_must_name_the_links_devices(explicit, fragment):
    from spark_cluster import spark_link_roce_hcas
    res = spark_link_roce_hcas(SPARK_LINK, explicit, "enp1s0f1np1")
    assert fragment in res["error"] and "enp1s0f1np1 -> rocep1s0f1" in res["error"]
    ok = spark_link_roce_hcas(SPARK_LINK, ["rocep1s0f1"], "enp1s0f1np1")
    assert ok["error"] == "" and ok["hcas"] == ["rocep1s0f1"]


_NS_SCRIPT = r"""
set -e
ip netns add {a}; ip netns add {b}
trap 'ip netns del {a}; ip netns del {b}' EXIT
ip link add {a}v type veth peer name {b}v
ip link set {a}v netns {a}; ip link set {b}v netns {b}
ip -n {a} addr add 192.168.77.1/24 dev {a}v; ip -n {b} addr add 192.168.77.2/24 dev {b}v
for n in {a} {b}; do ip -n $n link set lo up; done
ip -n {a} link set {a}v up; ip -n {b} link set {b}v up
ip netns exec {a} nft -f {fw}
ip netns exec {b} python3 -c "$SERVE" 8080 &
sleep 0.5
ip netns exec {a} python3 -c "$CONNECT" 192.168.77.2 8080 && echo "out ok"
for port in 29600 40000 6379 8000; do
  ip netns exec {a} python3 -c "$SERVE" $port &
  sleep 0.3
  if ip netns exec {b} python3 -c "$CONNECT" 192.168.77.1 $port
  then echo "in $port open"; else echo "in $port dropped"; fi
done
wait
"""


def test_the_firewall_in_a_kernel_drops_the_outsider_and_keeps_the_nodes_own_connections(tmp_path):
    """The rendered table loaded into a network namespace: the node's own connection out (a reply to its
    ephemeral local port) works; from a network that is not the link, VLLM_PORT, a port of the ephemeral
    range (where NCCL and Gloo listen) and Ray's GCS are dropped; a port it does not name stays open."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None:
        pytest.skip("needs root, ip and nft")
    fw = tmp_path / "fw.nft"
    fw.write_text(_firewall(["10.213.77.0/24"]))
    tag = f"t{os.getpid() % 10000}"
    script = _NS_SCRIPT.format(a=f"{tag}a", b=f"{tag}b", fw=fw)
    serve = ("import socket,sys,time; s=socket.socket(); "
             "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); s.settimeout(3)\ntry: s.accept()\n"
             "except OSError: pass\ntime.sleep(0.5)")
    env = dict(os.environ, SERVE=serve,
               CONNECT="import socket,sys; s=socket.socket(); s.settimeout(2); "
                       "sys.exit(s.connect_ex((sys.argv[1], int(sys.argv[2]))))")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False,
                          env=env)
    if proc.returncode != 0 and ("Operation not permitted" in proc.stderr or "Cannot create" in proc.stderr):
        pytest.skip(f"no network namespaces here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["out ok", "in 29600 dropped", "in 40000 dropped", "in 6379 dropped",
                                        "in 8000 open"], (proc.stdout, proc.stderr)
