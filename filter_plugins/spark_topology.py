"""Two-Spark inventories checked up front (playbooks/validate.yml), before the build and the download.

Pure Python (PyYAML, which Ansible itself needs); Ansible only needs the ``FilterModule`` at the bottom.

The cluster stage (roles/spark_link, roles/ray_cluster) checks the same settings again on the hosts;
this filter sees only the inventory, so it catches a missing or malformed setting in seconds instead
of after an hour of build and download. Role defaults are not host variables: the defaults that the
link and cluster roles would take are read from their defaults/main.yml (``DEFAULTS``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

_ROLES = Path(__file__).resolve().parents[1] / "roles"
# The defaults of another node's variables (a worker's hostvars may not hold them): read from the roles that
# define them, their one home (PyYAML, which Ansible itself needs).
_DEFAULT_NAMES = {"spark_link": ("spark_link_manage", "spark_link_interfaces", "spark_link_addresses",
                                 "spark_link_nccl_interface", "spark_link_nccl_ib_gid_index"),
                  "ray_cluster": ("ray_cluster_gpus_per_node",)}


def _role_defaults() -> dict[str, object]:
    out: dict[str, object] = {}
    for role, names in _DEFAULT_NAMES.items():
        values = yaml.safe_load((_ROLES / role / "defaults" / "main.yml").read_text(encoding="utf-8")) or {}
        out.update({name: values[name] for name in names})
    return out


DEFAULTS: dict[str, object] = _role_defaults()
_IFACE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,15}")
_EXAMPLE = "inventory/examples/two-sparks.yml"


def _var(hostvars: Mapping, host: str, name: str):
    values = hostvars.get(host) or {}
    value = values.get(name) if name in values else None
    return DEFAULTS.get(name) if value is None else value


def _int(value, default: int) -> int | None:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _link_errors(host: str, hostvars: Mapping) -> tuple[list[str], list]:
    """Errors of one node's link settings, and its interfaces' networks (None where unknown)."""
    errors: list[str] = []
    ifaces = _var(hostvars, host, "spark_link_interfaces")
    if not isinstance(ifaces, Sequence) or isinstance(ifaces, str) or not ifaces \
            or not all(isinstance(i, str) and _IFACE_RE.fullmatch(i) for i in ifaces):
        errors.append(f"{host}: spark_link_interfaces={ifaces!r} must list the link's interface names, "
                      f"e.g. [enp1s0f0np0, enP2p1s0f0np0] ({_EXAMPLE})")
        return errors, []
    nccl = _var(hostvars, host, "spark_link_nccl_interface")
    if nccl and nccl not in ifaces:
        errors.append(f"{host}: spark_link_nccl_interface={nccl!r} is not one of spark_link_interfaces "
                      f"({', '.join(ifaces)}); set it to one of them or \"\"")
    gid = _var(hostvars, host, "spark_link_nccl_ib_gid_index")
    if gid not in (None, "") and (isinstance(gid, bool) or not re.fullmatch(r"[0-9]{1,4}", str(gid))):
        errors.append(f"{host}: spark_link_nccl_ib_gid_index={gid!r} must be an integer >= 0 (the GID "
                      "index of this node's RoCEv2 link address, e.g. from show_gids or "
                      "/sys/class/infiniband/DEV/ports/1/gid_attrs/types/N) or \"\" to leave "
                      "NCCL_IB_GID_INDEX to NCCL")
    addresses = _var(hostvars, host, "spark_link_addresses")
    manage = _var(hostvars, host, "spark_link_manage")
    if not isinstance(addresses, Sequence) or isinstance(addresses, str):
        errors.append(f"{host}: spark_link_addresses={addresses!r} must be a list of CIDR addresses, one per "
                      f"interface of spark_link_interfaces ({_EXAMPLE})")
        return errors, []
    if not addresses:
        if manage is True:
            errors.append(f"{host}: spark_link_addresses is not set, and spark_link_manage is true (the role "
                          f"writes the link's netplan file from it): give this host one CIDR per interface "
                          f"of spark_link_interfaces ({', '.join(ifaces)}), e.g. "
                          f"spark_link_addresses: [192.168.100.10/24, 192.168.101.10/24] ({_EXAMPLE})")
        return errors, [None] * len(ifaces)
    if len(addresses) != len(ifaces):
        errors.append(f"{host}: spark_link_addresses has {len(addresses)} entries for {len(ifaces)} "
                      f"interfaces of spark_link_interfaces ({', '.join(ifaces)}): give one CIDR per "
                      f"interface, same order")
    networks = []
    for address in addresses:
        try:
            iface = ipaddress.ip_interface(str(address))
            if "/" not in str(address) or iface.version != 4 or iface.network.prefixlen == 0:
                raise ValueError
        except ValueError:
            errors.append(f"{host}: spark_link_addresses entry {address!r} is not an IPv4 CIDR "
                          "address such as 192.168.100.10/24")
            networks.append(None)
            continue
        networks.append(iface)
    return errors, networks


def spark_cluster_inventory_errors(groups: Mapping, hostvars: Mapping) -> list[str]:
    """Every problem of the inventory's cluster settings, one line each naming the setting to fix.

    A single Spark (no ``spark_workers``) only has its tensor-parallel size checked against its GPUs.
    """
    groups = groups or {}
    head = list(groups.get("spark_head") or [])
    workers = list(groups.get("spark_workers") or [])
    errors: list[str] = []
    first = (head or workers or list(groups.get("spark") or []) or [""])[0]
    tp_raw = _var(hostvars, first, "spark_tensor_parallel_size")
    tp = _int(tp_raw, 1)
    gpus = _int(_var(hostvars, first, "ray_cluster_gpus_per_node"), 1)
    if tp is None or tp < 1:
        errors.append(f"spark_tensor_parallel_size={tp_raw!r} must be an integer >= 1 (pass numbers as JSON: "
                      "-e '{\"spark_tensor_parallel_size\": 2}')")
    if gpus is None or gpus < 1:
        raw = _var(hostvars, first, "ray_cluster_gpus_per_node")
        errors.append(f"ray_cluster_gpus_per_node={raw!r} must be an integer >= 1")
    if not workers:
        if tp and gpus and tp > gpus:
            errors.append(f"spark_tensor_parallel_size={tp} needs {tp} GPUs, but the inventory has one Spark "
                          f"({gpus} GPU{'s' if gpus > 1 else ''}): put the other Sparks under spark_workers "
                          f"({_EXAMPLE}) or set spark_tensor_parallel_size to {gpus}")
        return errors
    if len(head) != 1:
        errors.append(f"spark_head has {len(head)} hosts ({', '.join(head) or 'none'}): put exactly "
                      f"one host in spark_head and the others in spark_workers ({_EXAMPLE})")
    both = sorted(set(head) & set(workers))
    if both:
        errors.append(f"{', '.join(both)} in both spark_head and spark_workers: a node is the head "
                      "or a worker")
    nodes = list(dict.fromkeys(head[:1] + workers))
    outside = [n for n in nodes if n not in (groups.get("spark") or [])]
    if outside:
        errors.append(f"{', '.join(outside)} not in the spark group: spark_head and spark_workers "
                      f"must be its children ({_EXAMPLE})")
    backend = _var(hostvars, first, "spark_distributed_backend") or "ray"
    if backend not in ("ray", "mp"):
        errors.append(f"spark_distributed_backend={backend!r} cannot span {len(nodes)} Sparks: set it to ray "
                      "(the default) or mp")
    if tp and gpus and tp > 1 and tp > len(nodes) * gpus:
        errors.append(f"spark_tensor_parallel_size={tp} is more than the {len(nodes) * gpus} GPUs of "
                      f"{len(nodes)} Sparks x ray_cluster_gpus_per_node={gpus}: set it to at most "
                      f"{len(nodes) * gpus} (unset, it is derived as nodes x GPUs)")
    per_node = {}
    for node in nodes:
        node_errors, networks = _link_errors(node, hostvars)
        errors += node_errors
        per_node[node] = networks
    seen: dict[str, str] = {}
    for node, networks in per_node.items():
        for net in networks:
            if net is None:
                continue
            ip = str(net.ip)
            if ip in seen:
                errors.append(f"{node} and {seen[ip]} both have the link address {ip} in "
                              "spark_link_addresses: give every node its own")
            seen.setdefault(ip, node)
    ref = per_node.get(nodes[0]) if nodes else None
    for node in nodes[1:]:
        for i, (a, b) in enumerate(zip(ref or [], per_node.get(node) or [], strict=False)):
            if a is not None and b is not None and a.network != b.network:
                errors.append(f"{node}: spark_link_addresses entry {i + 1} ({b}) is not on {nodes[0]}'s "
                              f"subnet {a.network}: the twin interfaces of linked Sparks share a subnet")
    if backend == "mp":
        head_addr = str(_var(hostvars, nodes[0], "spark_master_addr") or "") if nodes else ""
        ifaces = _var(hostvars, nodes[0], "spark_link_interfaces") if nodes else []
        nccl = _var(hostvars, nodes[0], "spark_link_nccl_interface") or (ifaces[0] if ifaces else "")
        head_nets = per_node.get(nodes[0]) or []
        idx = ifaces.index(nccl) if isinstance(ifaces, list) and nccl in ifaces else -1
        if not head_addr and not (0 <= idx < len(head_nets) and head_nets[idx] is not None):
            errors.append("spark_distributed_backend=mp needs the head's address: set spark_link_addresses "
                          f"on {nodes[0] if nodes else 'the head'} or spark_master_addr")
    return errors


class FilterModule:
    """Ansible filter: spark_cluster_inventory_errors."""

    def filters(self):
        return {"spark_cluster_inventory_errors": spark_cluster_inventory_errors}
