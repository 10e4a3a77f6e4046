"""Access between linked Sparks: Ray's pinned ports, the link's networks, restricted sync keys.

Pure Python (standard library only); Ansible only needs the ``FilterModule`` at the bottom.

- ``spark_ray_port_args``: the ``ray start`` arguments that pin every port Ray opens beyond loopback,
  so that the link firewall (roles/spark_link) can name them; by default Ray picks several at random.
- ``spark_ray_firewall_ports``: the same ports as nftables set elements (``6379``, ``10002-19999``).
- ``spark_link_networks``: the networks of the link's CIDR addresses (the firewall's allowed sources).
- ``spark_sync_key_options``: the ``authorized_keys`` options of a worker's key on the head:
  ``restrict``, the worker's link address, and one forced command (read-only rsync or one image export).
- ``spark_link_roce_hcas``: the RoCE devices NCCL_IB_HCA names (derived from each link interface's
  ``/sys/class/net/IFACE/device/infiniband/*``, or the owner's list checked against them), or the error.
- ``spark_ray_env_exclude``: the names of a node's cluster environment file, as the list vLLM reads from
  ``VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json`` (names not to copy from the head onto Ray workers).
- ``spark_nccl_transport``: which network NCCL chose, read from a server's log with ``NCCL_DEBUG=INFO``
  (``Using network IB`` over the RoCE devices, or a fallback to TCP sockets, with the reason the log gives).
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


def spark_link_roce_hcas(find_results: Sequence[Mapping], explicit: Sequence[str], nccl_iface: str) -> dict:
    """The RoCE devices for NCCL_IB_HCA from the ``find`` results of
    ``/sys/class/net/IFACE/device/infiniband``
    (one per link interface, ``item`` = interface). Returns ``by_iface``, ``hcas`` and ``error`` ("" = fine):
    every interface must have a device; an explicit list must name only the link's devices, the NCCL
    interface's among them; [] derives every interface's devices, in the interfaces' order."""
    by_iface: dict[str, list[str]] = {}
    for res in find_results or []:
        iface = str(res.get("item", ""))
        by_iface[iface] = sorted(str(f.get("path", "")).rstrip("/").rsplit("/", 1)[-1]
                                 for f in res.get("files") or [])
    listing = "; ".join(f"{i} -> {', '.join(d) or 'none'}" for i, d in by_iface.items())
    missing = [i for i, d in by_iface.items() if not d]
    if missing:
        return {"by_iface": by_iface, "hcas": [],
                "error": f"link interface {', '.join(missing)} has no RoCE device "
                         f"(/sys/class/net/{missing[0]}/"
                         f"device/infiniband is missing or empty)"}
    found = [d for devs in by_iface.values() for d in devs]
    hcas = [str(h) for h in explicit or []] or found
    foreign = [h for h in hcas if h not in found]
    if foreign or not set(hcas) & set(by_iface.get(nccl_iface, [])):
        what = (f"names {', '.join(foreign)}, which is not a RoCE device of the link" if foreign
                else f"does not name the RoCE device of the NCCL interface {nccl_iface}")
        return {"by_iface": by_iface, "hcas": hcas,
                "error": f"spark_link_ib_hcas={list(explicit or [])} {what} (the link's devices: {listing}); "
                         f"set "
                         f"spark_link_ib_hcas to [] to derive them, or to devices of that list"}
    return {"by_iface": by_iface, "hcas": hcas, "error": ""}


# NCCL's own INFO lines (NVIDIA/nccl, the same text from 2.27 to 2.29):
#   src/init.cc            INFO(NCCL_INIT, "Using network %s", ...)  -- the network the communicator uses;
#                          its name is "IB" (src/transport/net_ib/common.cc) or "Socket" (net_socket.cc)
#   net_ib init            "NET/IB : Using%s %s; OOB %s:%s" with " [%d]%s:%d/%s" per device: index, device,
#                          port, link layer "IB" / "RoCE" (NCCL_IB_LLSTR)
#   net_ib init            "NET/IB : No device found."   (no RDMA device, or NCCL_IB_HCA matched none)
#   net_ib init            "NET/IB : Unable to open device %s"
#   src/misc/ibvsymbols.cc "Failed to open libibverbs.so[.1]"   (no RDMA user libraries in the image)
#   net_socket.cc          "NET/Socket : Using%s" with " [%d]%s:%s" per interface
_NCCL_NETWORK_RE = re.compile(r"NCCL INFO Using network (\S+)")
_NCCL_IB_LINE_RE = re.compile(r"NET/IB : Using((?: \[\d+\][^\s:\[]+:\d+/[A-Za-z]+)+)")
_NCCL_IB_DEV_RE = re.compile(r"\[\d+\]([^\s:\[]+):(\d+)/([A-Za-z]+)")
_NCCL_SOCKET_RE = re.compile(r"NET/Socket : Using((?: \[\d+\][^\s:]+:\S+)+)")
_NCCL_FALLBACK_CAUSES = (
    ("Failed to open libibverbs.so",
     "the container has no RDMA user libraries (libibverbs1, ibverbs-providers, "
     "librdmacm1: templates/Dockerfile.j2's runtime stage; rebuild the image)"),
    ("NET/IB : No device found.",
     "NCCL saw no RDMA device: /dev/infiniband is not in the container (docker run "
                                  "--device /dev/infiniband), or NCCL_IB_HCA={hcas} names no device there"),
    ("NET/IB : Unable to open device", "an RDMA device could not be opened in the container (--device "
                                       "/dev/infiniband and --ulimit memlock=-1:-1 are needed)"),
)


def spark_nccl_transport(log: str, hcas: Sequence[str] | str = ()) -> dict:
    """Which network NCCL chose, from the ``NCCL_DEBUG=INFO`` lines of a log (every rank's lines; Ray
    forwards its workers' output to the server's).

    ``hcas``: the devices NCCL was told to use (NCCL_IB_HCA, a list or its comma-separated value); each
    device NCCL uses must match one (NCCL matches names by prefix). Returns ``ok``, ``transport`` (``IB``,
    ``Socket``, another plugin's name, or ``none``), ``devices`` (``name:port/linklayer``) and ``reason``,
    one line naming the problem and the fix, or what NCCL uses.
    """
    text = log if isinstance(log, str) else ""
    if isinstance(hcas, str):
        hcas = [h for h in hcas.split(",") if h]
    hcas = [str(h).lstrip("^=").split(":")[0] for h in hcas or []]
    networks = _NCCL_NETWORK_RE.findall(text)
    devices: list[str] = []
    for m in _NCCL_IB_LINE_RE.finditer(text):
        for name, port, link in _NCCL_IB_DEV_RE.findall(m.group(1)):
            dev = f"{name}:{port}/{link}"
            if dev not in devices:
                devices.append(dev)
    hca_text = ",".join(hcas) or "(unset)"
    if not networks:
        return {"ok": False, "transport": "none", "devices": devices,
                "reason": "NCCL printed no 'Using network' line: NCCL_DEBUG=INFO must reach the server and "
                          "its Ray "
                          "workers (the cluster environment, roles/spark_link) and the server must run "
                          "tensor-parallel across the nodes"}
    others = sorted({n for n in networks if not n.startswith("IB")})
    if others:
        transport = "Socket" if "Socket" in others else others[0]
        causes = [why.format(hcas=hca_text) for needle, why in _NCCL_FALLBACK_CAUSES if needle in text]
        sockets = _NCCL_SOCKET_RE.search(text)
        where = f" over{sockets.group(1)}" if sockets else ""
        what = ("NCCL fell back to TCP sockets" if transport == "Socket"
                else f"NCCL uses the network {transport}")
        return {"ok": False, "transport": transport, "devices": devices,
                "reason": f"{what}{where} on {networks.count(transport)} of {len(networks)} communicators: "
                          + ("; ".join(causes) if causes else
                             f"the log names no cause (check NCCL_IB_DISABLE=0 and NCCL_IB_HCA={hca_text} "
                             f"against `ls /sys/class/infiniband` in the container)")}
    foreign = [d for d in devices if hcas and not any(d.split(":")[0].startswith(h) for h in hcas)]
    if foreign:
        return {"ok": False, "transport": "IB", "devices": devices,
                "reason": f"NCCL uses {', '.join(foreign)}, not the link's RoCE devices "
                          f"NCCL_IB_HCA={hca_text}"}
    return {"ok": True, "transport": "IB", "devices": devices,
            "reason": f"NCCL uses IB verbs over {', '.join(devices) or 'its RDMA devices'} "
                      f"({len(networks)} communicators)"}


_ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=", re.M)


def spark_ray_env_exclude(env_text: str) -> list[str]:
    """Every variable name a ``NAME=VALUE`` cluster environment file sets, unique and sorted.

    vLLM's Ray executor copies the head's ``NCCL_*``/``UCX_*``/``VLLM_*`` variables onto every worker (0.19.1,
    0.20.0, 0.26.0 ``vllm/ray/ray_env.py``); names in this list are left out, so each node keeps what its own
    cluster file (its interface, its RoCE devices) gave its Ray unit. Comments and blank lines are skipped.
    """
    if not isinstance(env_text, str):
        raise ValueError(f"expected the cluster environment file's text, got {type(env_text).__name__}")
    return sorted(set(_ENV_LINE.findall(env_text)))


class FilterModule:
    """Ansible filters of cluster access (ports, networks, key options)."""

    def filters(self):
        return {
            "spark_ray_port_args": spark_ray_port_args,
            "spark_ray_firewall_ports": spark_ray_firewall_ports,
            "spark_link_networks": spark_link_networks,
            "spark_sync_key_options": spark_sync_key_options,
            "spark_nccl_transport": spark_nccl_transport,
            "spark_link_roce_hcas": spark_link_roce_hcas,
            "spark_ray_env_exclude": spark_ray_env_exclude,
        }
