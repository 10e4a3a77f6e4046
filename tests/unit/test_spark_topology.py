"""Two-Spark inventories checked in playbooks/validate.yml (filter_plugins/spark_topology.py, issue 31
item 4): the message names the missing or wrong setting, before the build and the download."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from spark_topology import DEFAULTS, FilterModule, spark_cluster_inventory_errors

ROOT = Path(__file__).resolve().parents[2]


def _two(head: dict | None = None, worker: dict | None = None, common: dict | None = None):
    groups = {"spark": ["s1", "s2"], "spark_head": ["s1"], "spark_workers": ["s2"]}
    base = {"spark_link_manage": True, "spark_link_interfaces": ["enp1s0f0np0", "enP2p1s0f0np0"],
            "spark_tensor_parallel_size": 1, **(common or {})}
    hostvars = {
        "s1": {**base, "spark_link_addresses": ["192.168.100.10/24", "192.168.101.10/24"], **(head or {})},
        "s2": {**base, "spark_link_addresses": ["192.168.100.11/24", "192.168.101.11/24"], **(worker or {})},
    }
    return groups, hostvars


def test_a_good_two_spark_inventory_passes():
    assert spark_cluster_inventory_errors(*_two()) == []
    assert spark_cluster_inventory_errors(*_two(common={"spark_distributed_backend": "mp"})) == []
    assert "spark_cluster_inventory_errors" in FilterModule().filters()


def test_the_missing_link_addresses_are_named_with_the_host():
    groups, hostvars = _two()
    del hostvars["s2"]["spark_link_addresses"]
    (error,) = spark_cluster_inventory_errors(groups, hostvars)
    assert error.startswith("s2: spark_link_addresses is not set, and spark_link_manage is true")
    assert "enp1s0f0np0, enP2p1s0f0np0" in error and "two-sparks.yml" in error


def test_without_manage_the_addresses_may_come_from_the_interfaces():
    groups, hostvars = _two(common={"spark_link_manage": False})
    del hostvars["s2"]["spark_link_addresses"]
    assert spark_cluster_inventory_errors(groups, hostvars) == []


@pytest.mark.parametrize(
    ("worker", "needle"),
    [
        ({"spark_link_addresses": ["192.168.100.11/24"]}, "s2: spark_link_addresses has 1 entries for 2"),
        ({"spark_link_addresses": ["192.168.100.11", "192.168.101.11/24"]},
         "'192.168.100.11' is not an IPv4"),
        ({"spark_link_addresses": ["fe80::1/64", "192.168.101.11/24"]}, "is not an IPv4 CIDR"),
        ({"spark_link_addresses": ["192.168.100.10/24", "192.168.101.11/24"]},
         "s2 and s1 both have the link address 192.168.100.10"),
        ({"spark_link_addresses": ["192.168.200.11/24", "192.168.101.11/24"]},
         "s2: spark_link_addresses entry 1 (192.168.200.11/24) is not on s1's subnet 192.168.100.0/24"),
        ({"spark_link_nccl_interface": "eth9"}, "s2: spark_link_nccl_interface='eth9' is not one of"),
        ({"spark_link_interfaces": []}, "s2: spark_link_interfaces=[] must list"),
        ({"spark_link_nccl_ib_gid_index": -1}, "s2: spark_link_nccl_ib_gid_index=-1 must be an integer >= 0"),
        ({"spark_link_nccl_ib_gid_index": "three"},
         "s2: spark_link_nccl_ib_gid_index='three' must be an integer"),
        ({"spark_link_nccl_ib_gid_index": True}, "s2: spark_link_nccl_ib_gid_index=True must be an integer"),
        ({"spark_link_addresses": "192.168.100.11/24"},
         "s2: spark_link_addresses='192.168.100.11/24' must be a list"),
    ],
)
def test_bad_link_settings_are_named(worker, needle):
    errors = spark_cluster_inventory_errors(*_two(worker=worker))
    assert any(needle in e for e in errors), errors


def test_the_gid_index_is_per_node_an_integer_or_empty():
    """NCCL_IB_GID_INDEX per node: the RoCEv2 index of a node's own link address may differ between two
    Sparks (4 on one, 3 on the other: MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks pull request 26)."""
    assert spark_cluster_inventory_errors(*_two(head={"spark_link_nccl_ib_gid_index": 4},
                                                worker={"spark_link_nccl_ib_gid_index": "3"})) == []
    assert spark_cluster_inventory_errors(*_two(worker={"spark_link_nccl_ib_gid_index": 0})) == []
    assert spark_cluster_inventory_errors(*_two(worker={"spark_link_nccl_ib_gid_index": ""})) == []
    assert DEFAULTS["spark_link_nccl_ib_gid_index"] == ""


@pytest.mark.parametrize(
    ("common", "needle"),
    [
        ({"spark_tensor_parallel_size": 4},
         "spark_tensor_parallel_size=4 is more than the 2 GPUs of 2 Sparks"),
        ({"spark_tensor_parallel_size": "two"}, "spark_tensor_parallel_size='two' must be an integer >= 1"),
        ({"spark_distributed_backend": "uni"}, "spark_distributed_backend='uni' cannot span 2 Sparks"),
    ],
)
def test_tensor_parallel_size_and_backend_against_the_hosts(common, needle):
    errors = spark_cluster_inventory_errors(*_two(common=common))
    assert any(needle in e for e in errors), errors
    assert spark_cluster_inventory_errors(*_two(common={"spark_tensor_parallel_size": 2})) == []
    assert spark_cluster_inventory_errors(
        *_two(common={"spark_tensor_parallel_size": 4, "ray_cluster_gpus_per_node": 2})) == []


def test_the_groups_must_have_one_head():
    groups, hostvars = _two()
    groups["spark_head"] = []
    assert any("spark_head has 0 hosts" in e for e in spark_cluster_inventory_errors(groups, hostvars))
    groups["spark_head"] = ["s1", "s2"]
    assert any("s2 in both spark_head and spark_workers" in e
               for e in spark_cluster_inventory_errors(groups, hostvars))


def test_mp_needs_the_heads_address():
    groups, hostvars = _two(common={"spark_distributed_backend": "mp", "spark_link_manage": False})
    del hostvars["s1"]["spark_link_addresses"]
    (error,) = spark_cluster_inventory_errors(groups, hostvars)
    assert "spark_distributed_backend=mp needs the head's address" in error
    hostvars["s1"]["spark_master_addr"] = "192.168.100.10"
    assert spark_cluster_inventory_errors(groups, hostvars) == []


def test_a_single_spark_has_one_gpu():
    groups = {"spark": ["localhost"]}
    assert spark_cluster_inventory_errors(groups, {"localhost": {"spark_tensor_parallel_size": 1}}) == []
    (error,) = spark_cluster_inventory_errors(groups, {"localhost": {"spark_tensor_parallel_size": 2}})
    assert "spark_tensor_parallel_size=2 needs 2 GPUs, but the inventory has one Spark" in error
    assert "spark_workers" in error


def test_the_defaults_are_the_roles_defaults():
    roles = {}
    for role in ("spark_link", "ray_cluster"):
        roles.update(yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()))
    for name, value in DEFAULTS.items():
        assert roles[name] == value, name


def _inventory(node, groups: dict, hostvars: dict, name: str = "all", inherited: dict | None = None):
    members = groups.setdefault(name, [])
    here = {**(inherited or {}), **(node.get("vars") or {})}
    for host, values in (node.get("hosts") or {}).items():
        hostvars.setdefault(host, {}).update({**here, **(values or {})})
        members.append(host)
    for child, sub in (node.get("children") or {}).items():
        _inventory(sub or {}, groups, hostvars, child, here)
        members.extend(h for h in groups[child] if h not in members)


def _check_inventory(data: dict, extra_host_vars: dict | None = None):
    groups: dict = {}
    hostvars: dict = {}
    for name, node in data.items():
        _inventory(node or {}, groups, hostvars, name)
    group_vars = {}
    for f in sorted((ROOT / "group_vars" / "all").glob("*.yml")):
        group_vars.update(yaml.safe_load(f.read_text()) or {})
    for host, values in (extra_host_vars or {}).items():
        hostvars.setdefault(host, {}).update(values)
    hostvars = {h: {**group_vars, **v} for h, v in hostvars.items()}
    return spark_cluster_inventory_errors(groups, hostvars)


def test_the_shipped_two_spark_example_passes():
    data = yaml.safe_load((ROOT / "inventory/examples/two-sparks.yml").read_text())
    assert _check_inventory(data) == []


def test_the_cluster_scenario_passes():
    mol = yaml.safe_load((ROOT / "molecule/cluster/molecule.yml").read_text())
    scenario = ROOT / "molecule" / "cluster"
    spark_vars = yaml.safe_load((scenario / "group_vars/spark.yml").read_text())
    data = {"spark": {"children": {}}}
    host_vars = {}
    for platform in mol["platforms"]:
        for group in platform["groups"]:
            if group != "spark":
                data["spark"]["children"].setdefault(group, {"hosts": {}})["hosts"][platform["name"]] = {}
        host_vars[platform["name"]] = {**spark_vars, **(yaml.safe_load(
            (scenario / "host_vars" / f"{platform['name']}.yml").read_text()) or {})}
    assert _check_inventory(data, host_vars) == []
