"""Access between linked Sparks: Ray's pinned ports, the link's networks, restricted sync keys.

Pure Python (standard library only); Ansible only needs the ``FilterModule`` at the bottom.

- ``spark_ray_port_args``: the ``ray start`` arguments that pin every port Ray opens beyond loopback,
  so that the link firewall (roles/spark_link) can name them; by default Ray picks several at random.
- ``spark_ray_firewall_ports``: the same ports as nftables set elements (``6379``, ``10002-19999``).
- ``spark_link_networks``: the networks of the link's CIDR addresses (the firewall's allowed sources).
- ``spark_sync_key_options``: the ``authorized_keys`` options of a worker's key on the head:
  ``restrict``, the worker's link address, and one forced command (read-only rsync or one image export).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence

# Name in spark_ray_ports -> (ray start option, head only). min_worker/max_worker form one range.
RAY_PORT_OPTIONS: dict[str, tuple[str, bool]] = {
    "gcs": ("--port", True),
    "dashboard": ("--dashboard-port", True),
    "client_server": ("--ray-client-server-port", True),
    "node_manager": ("--node-manager-port", False),
    "object_manager": ("--object-manager-port", False),
    "runtime_env_agent": ("--runtime-env-agent-port", False),
    "dashboard_agent_grpc": ("--dashboard-agent-grpc-port", False),
    "dashboard_agent_http": ("--dashboard-agent-listen-port", False),
    "metrics_export": ("--metrics-export-port", False),
    "min_worker": ("--min-worker-port", False),
    "max_worker": ("--max-worker-port", False),
}
# Fixed ports Ray opens without a ray start option (metrics of the head's autoscaler and dashboard).
RAY_FIXED_PORTS: dict[str, int] = {"autoscaler_metrics": 44217, "dashboard_metrics": 44227}

_SAFE_WORD = re.compile(r"^[A-Za-z0-9_./:@=+-]+$")


def _ports(ports: Mapping[str, object]) -> dict[str, int]:
    if not isinstance(ports, Mapping):
        raise ValueError(f"spark_ray_ports must be a mapping of name -> port, got {ports!r}")
    unknown = sorted(set(ports) - set(RAY_PORT_OPTIONS))
    missing = sorted(set(RAY_PORT_OPTIONS) - set(ports))
    if unknown or missing:
        raise ValueError(f"spark_ray_ports: unknown names {unknown}, missing names {missing}; it needs "
                         f"exactly {sorted(RAY_PORT_OPTIONS)} (see group_vars/all/main.yml)")
    out: dict[str, int] = {}
    for name, value in ports.items():
        try:
            port = int(str(value))
        except ValueError:
            port = 0
        if not 1024 <= port <= 65535:
            raise ValueError(f"spark_ray_ports.{name} = {value!r} is not a port between 1024 and 65535")
        out[name] = port
    if out["min_worker"] > out["max_worker"]:
        raise ValueError(f"spark_ray_ports: min_worker {out['min_worker']} is above "
                         f"max_worker {out['max_worker']}")
    singles = {n: p for n, p in out.items() if n not in ("min_worker", "max_worker")}
    singles.update(RAY_FIXED_PORTS)
    seen: dict[int, str] = {}
    for name, port in singles.items():
        if port in seen:
            raise ValueError(f"spark_ray_ports: {name} and {seen[port]} both use port {port}")
        if out["min_worker"] <= port <= out["max_worker"]:
            raise ValueError(f"spark_ray_ports: {name} ({port}) lies in the worker range "
                             f"{out['min_worker']}-{out['max_worker']}; move one of them")
        seen[port] = name
    return out


def spark_ray_port_args(ports: Mapping[str, object], head: bool) -> list[str]:
    """``ray start`` arguments pinning every port of this node (head-only ports only on the head)."""
    checked = _ports(ports)
    args: list[str] = []
    for name, (option, head_only) in RAY_PORT_OPTIONS.items():
        if head_only and not head:
            continue
        args += [option, str(checked[name])]
    return args


def spark_ray_firewall_ports(ports: Mapping[str, object]) -> list[str]:
    """Every TCP port Ray may open on a node, as nftables set elements, sorted."""
    checked = _ports(ports)
    singles = sorted({p for n, p in checked.items() if n not in ("min_worker", "max_worker")}
                     | set(RAY_FIXED_PORTS.values()))
    elements = [str(p) for p in singles]
    elements.append(f"{checked['min_worker']}-{checked['max_worker']}")
    return sorted(elements, key=lambda e: int(e.split("-")[0]))


def spark_link_networks(addresses: Sequence[str]) -> list[str]:
    """The IPv4 networks of CIDR addresses (``10.0.0.5/24`` -> ``10.0.0.0/24``), unique, in order."""
    if isinstance(addresses, str) or not isinstance(addresses, Sequence):
        raise ValueError(f"expected a list of CIDR addresses, got {addresses!r}")
    out: list[str] = []
    for address in addresses:
        try:
            iface = ipaddress.ip_interface(str(address))
        except ValueError:
            raise ValueError(f"{address!r} is not a CIDR address such as 10.0.0.1/24 "
                             "(spark_link_addresses, or the link interface's address)") from None
        if iface.version != 4 or "/" not in str(address):
            raise ValueError(f"{address!r}: the link firewall needs IPv4 CIDR addresses such as 10.0.0.1/24")
        if iface.network.prefixlen == 0:
            raise ValueError(f"{address!r}: a /0 network would open Ray to every address; "
                             "use the link's prefix")
        net = str(iface.network)
        if net not in out:
            out.append(net)
    if not out:
        raise ValueError("no link address to allow Ray's ports from: set spark_link_addresses "
                         "(one CIDR per interface)")
    return out


def spark_sync_key_options(from_ip: str, command: Sequence[str]) -> str:
    """``authorized_keys`` options: no forwarding, pty or rc (``restrict``), one source, one forced command.

    The forced command runs whatever the client asks for (sshd puts the request in
    SSH_ORIGINAL_COMMAND); its words are plain (no quoting, no shell syntax) so the line cannot be
    widened by a crafted path or image name.
    """
    try:
        ip = ipaddress.ip_address(str(from_ip))
    except ValueError:
        raise ValueError(f"the worker's link address {from_ip!r} is not an IP address") from None
    if isinstance(command, str) or not command:
        raise ValueError(f"the forced command must be a non-empty list of words, got {command!r}")
    bad = [w for w in command if not isinstance(w, str) or not _SAFE_WORD.match(w)]
    if bad:
        raise ValueError(f"forced command words {bad!r} have characters other than letters, digits and "
                         "_./:@=+-; use plain paths and image names")
    return f'restrict,from="{ip}",command="{" ".join(command)}"'


class FilterModule:
    """Ansible filters of cluster access (ports, networks, key options)."""

    def filters(self):
        return {
            "spark_ray_port_args": spark_ray_port_args,
            "spark_ray_firewall_ports": spark_ray_firewall_ports,
            "spark_link_networks": spark_link_networks,
            "spark_sync_key_options": spark_sync_key_options,
        }
