"""Unit tests for filter_plugins/spark_cluster.py: Ray's pinned ports, the link's networks, the
restricted options of a worker's key on the head; and the link firewall's nftables template."""

from __future__ import annotations

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
from unit.test_templates import render

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
                                             "spark_link_networks", "spark_sync_key_options"}


def _firewall(nets: list[str]) -> str:
    return render("sparkllm-link-firewall.nft.j2", inventory_hostname="spark-a",
                  _spark_link_fw_table="sparkllm", _spark_link_fw_unit="sparkllm-link-firewall.service",
                  _spark_link_fw_ports=spark_ray_firewall_ports(PORTS), _spark_link_fw_nets=nets)


def test_firewall_drops_only_ray_ports_from_outside_the_link():
    text = _firewall(["192.168.100.0/24", "192.168.101.0/24"])
    rules = [line.strip() for line in text.split("chain input {", 1)[1].splitlines() if line.strip()]
    assert rules[0] == "type filter hook input priority filter; policy accept;"
    # loopback and the link first; the only drop names Ray's TCP ports (other traffic is untouched)
    assert rules[1:4] == ['iifname "lo" accept', "ip saddr @link_nets accept",
                          'tcp dport @ray_tcp_ports counter drop comment "Ray port from outside the link"']
    assert sum("drop" in r for r in rules) == 1
    assert "elements = { 192.168.100.0/24, 192.168.101.0/24 }" in text
    assert "elements = { 6379, 6380," in text and "10002-19999" in text
    # reloading replaces the table in one transaction
    assert text.index("delete table inet sparkllm") < text.index("table inet sparkllm {")


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft not installed")
def test_firewall_file_parses_with_nft(tmp_path):
    path = tmp_path / "fw.nft"
    path.write_text(_firewall(["10.0.0.0/24"]))
    proc = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr:
        pytest.skip("nft -c needs CAP_NET_ADMIN")
    assert proc.returncode == 0, proc.stderr
