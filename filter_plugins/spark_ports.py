"""Is the API's port free on the Spark? Decided in preflight, before anything is built or changed.

The serve stage binds two places: vLLM on ``vllm_host:vllm_port``, or, when ``vllm_host`` is not loopback
(the LAN proxy, roles/serve/vars/main.yml ``_serve_proxy``), vLLM on ``127.0.0.1:vllm_proxy_upstream_port``
and nginx on ``vllm_host:vllm_port``. ``spark_port_binds`` lists them by the serve role's rule, and
``spark_port_check`` compares them with the listening TCP sockets ``ss -Hltnp`` prints: a listener that
overlaps a bind is refused unless it is ours (the serve stage stops or replaces it):

- vLLM's bind: one of our method units (``<serve_unit_prefix>-<method>.service``) is running. That is the
  serve stage's own rule (roles/serve/tasks/switch.yml probes the port only while none of them runs): the
  container runs with ``--network host``, so its listener's process is the server inside the container,
  not the unit's.
- nginx's bind: also nginx while our proxy site (``serve_proxy_site_file``) exists.

Why refuse instead of leaving it to the serve stage: vLLM 0.19.1 binds its socket with SO_REUSEADDR and
SO_REUSEPORT (vllm/entrypoints/openai/api_server.py:490-498), so against a listener of the same user that
also set SO_REUSEPORT (a leftover vLLM) the bind succeeds and the kernel shares the connections between the
two servers; against any other holder it fails at the end of a deploy. ``--host`` unset or "" binds every
IPv4 address (api_server.py:549, ``args.host or ""``; AF_INET unless the host is an IPv6 literal, :491-493).

How ss prints an address (iproute2 6.1, measured with python3 sockets): ``0.0.0.0:P`` every IPv4 address,
``[::]:P`` every IPv6 address (IPV6_V6ONLY), ``*:P`` every address of both families (an IPv6 socket without
IPV6_V6ONLY), ``[::ffff:a.b.c.d]:P`` an IPv4-mapped address, ``127.0.0.53%lo:P`` an address on one
interface. Standard library only.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence

# process entries of ss -p: users:(("nginx",pid=812,fd=6),("nginx",pid=813,fd=6))
_PROC_RE = re.compile(r'\("((?:[^"\\]|\\.)*)",pid=(\d+),fd=\d+\)')
# states in which a unit's processes may hold the port (systemctl is-active)
_UNIT_UP = {"active", "activating", "reloading", "deactivating"}
_ANY = "any"  # a wildcard of both families (ss "*", vLLM's AF_INET6 "::" without IPV6_V6ONLY)


class PortCheckError(ValueError):
    """Inputs the check cannot use (a port that is not a number)."""


def _port(name: str, value) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise PortCheckError(f"{name}={value!r} is not a port number; set it to an integer from 1 to "
                             "65535") from None
    if not 1 <= port <= 65535:
        raise PortCheckError(f"{name}={value!r} is out of range; set it to a port from 1 to 65535")
    return port


def serve_uses_proxy(vllm_host) -> bool:
    """The serve role's rule (roles/serve/vars/main.yml ``_serve_proxy``): not loopback -> nginx in front."""
    host = str(vllm_host)
    return not (host.lower() in ("localhost", "::1", "[::1]") or re.match(r"127[.]", host) is not None)


def spark_port_binds(vllm_host, vllm_port, upstream_port) -> list[dict]:
    """What the serve stage will bind: [{who, host, port, knob}], vLLM first."""
    port = _port("vllm_port", vllm_port)
    if serve_uses_proxy(vllm_host):
        upstream = _port("vllm_proxy_upstream_port", upstream_port)
        return [{"who": "vLLM (behind the LAN proxy)", "host": "127.0.0.1", "port": upstream,
                 "knob": "vllm_proxy_upstream_port", "proxy": False},
                {"who": "the LAN proxy (nginx)", "host": str(vllm_host), "port": port, "knob": "vllm_port",
                 "proxy": True}]
    return [{"who": "vLLM", "host": str(vllm_host), "port": port, "knob": "vllm_port", "proxy": False}]


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host, int(port)


def _scope(host: str, listener: bool):
    """(family, address or None for every address of it); family 4, 6 or _ANY; address None = unknown name."""
    host = host.split("%", 1)[0].strip("[]")
    if host == "*":
        return _ANY, None
    if not listener and (host == "" or host.lower() == "localhost"):
        # vLLM: "" binds every IPv4 address; localhost resolves to 127.0.0.1 (AF_INET, api_server.py:491)
        return 4, (None if host == "" else ipaddress.ip_address("127.0.0.1"))
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None, None  # a host name: resolved only when the server binds
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return 4, ip.ipv4_mapped
    if ip.is_unspecified and ip.version == 6:
        # ss "[::]" is IPv6 only; vLLM's "::" has no IPV6_V6ONLY: both families (Linux default bindv6only=0)
        return (6 if listener else _ANY), None
    if ip.is_unspecified:
        return 4, None
    return ip.version, ip


def _overlaps(listener_host: str, bind_host: str) -> bool:
    lfam, lip = _scope(listener_host, listener=True)
    bfam, bip = _scope(bind_host, listener=False)
    if lfam is None or bfam is None:
        return True  # a name on either side: any listener on the port may be it
    if lfam != _ANY and bfam != _ANY and lfam != bfam:
        return False
    return lip is None or bip is None or lip == bip


def parse_ss_listeners(text: str) -> list[dict]:
    """``ss -Hltnp`` (or with its header) -> [{address, host, port, processes: [{name, pid}]}]."""
    out = []
    for line in str(text or "").splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[0] != "LISTEN":
            continue
        split = _split(fields[3])
        if split is None:
            continue
        procs = [{"name": name.replace('\\"', '"'), "pid": int(pid)}
                 for name, pid in _PROC_RE.findall(" ".join(fields[5:]))]
        out.append({"address": fields[3], "host": split[0], "port": split[1], "processes": procs})
    return out


def parse_ps_units(text: str) -> dict[int, str]:
    """``ps -e -o pid=,unit=`` -> {pid: unit}; "-" (no unit) left out."""
    out = {}
    for line in str(text or "").splitlines():
        fields = line.split(None, 1)
        if len(fields) == 2 and fields[0].isdigit() and fields[1].strip() not in ("", "-"):
            out[int(fields[0])] = fields[1].strip()
    return out


def _active_units(units: Sequence[str], states: Sequence[str] | str) -> list[str]:
    if isinstance(states, str):
        states = states.splitlines()
    return [u for u, s in zip(units, states, strict=False) if str(s).strip() in _UNIT_UP]


def _holder(listener: Mapping, units: Mapping[int, str]) -> str:
    """``nginx (pids 812, 813; nginx.service)``: one entry per process name and unit."""
    if not listener["processes"]:
        return "a process ss does not name (run as root to see it)"
    groups: dict[tuple[str, str], list[str]] = {}
    for p in listener["processes"]:
        pids = groups.setdefault((p["name"], units.get(p["pid"], "")), [])
        if str(p["pid"]) not in pids:
            pids.append(str(p["pid"]))
    return ", ".join(f"{name} (pid{'s' if len(pids) > 1 else ''} {', '.join(pids)}"
                     f"{'; ' + unit if unit else ''})" for (name, unit), pids in groups.items())


def _stop_hint(listener: Mapping, units: Mapping[int, str]) -> str:
    names = [units.get(p["pid"], "") for p in listener["processes"]]
    services = sorted({u for u in names if u.endswith(".service")})
    if any(u.startswith("docker-") and u.endswith(".scope") for u in names):
        return "stop that container (`docker ps` names it; `docker stop NAME`)"
    if services:
        return f"stop that service (sudo systemctl disable --now {' '.join(services)})"
    if listener["processes"]:
        pids = sorted({str(p["pid"]) for p in listener["processes"]})
        return f"stop that process (pid {', '.join(pids)})"
    return "stop what holds it (sudo ss -ltnp names it)"


def _free_port(start: int, held: set[int], avoid: set[int]) -> int | None:
    for port in list(range(start + 1, 65536)) + list(range(1024, start)):
        if port not in held and port not in avoid:
            return port
    return None


def spark_port_check(ss_text, binds: Iterable[Mapping], server_units: Sequence[str] = (),
                     server_states: Sequence[str] | str = (), proxy_site: bool = False,
                     ps_text: str = "") -> dict:
    """Which of ``binds`` another service holds: {ok, message, conflicts: [{bind, listener, holder}], ours}.

    ``server_units``/``server_states``: our method units and ``systemctl is-active`` of each (same order);
    ``proxy_site``: our nginx site file exists; ``ps_text``: ``ps -e -o pid=,unit=`` (names the holder's
    unit). A unit missing from ``server_states`` counts as not running.
    """
    binds = list(binds)
    listeners = parse_ss_listeners(ss_text)
    units = parse_ps_units(ps_text)
    running = _active_units(list(server_units), server_states)
    conflicts, ours = [], []
    for bind in binds:
        for lst in listeners:
            if lst["port"] != int(bind["port"]) or not _overlaps(lst["host"], str(bind["host"])):
                continue
            names = {p["name"] for p in lst["processes"]}
            is_nginx = bool(names) and names <= {"nginx"}
            mine = (proxy_site and is_nginx) or (bool(running) and not is_nginx)
            (ours if mine else conflicts).append({"bind": dict(bind), "listener": lst["address"],
                                                  "holder": _holder(lst, units),
                                                  "hint": _stop_hint(lst, units)})
    if not conflicts:
        where = ", ".join(f"{b['host']}:{b['port']}" for b in binds)
        note = (f" ({len(ours)} held by this toolkit's server or proxy, replaced by the serve stage)"
                if ours else "")
        return {"ok": True, "conflicts": [], "ours": ours, "message": f"port check: {where} free{note}"}
    held = {lst["port"] for lst in listeners}
    lines = []
    for bind in binds:
        mine = [c for c in conflicts if c["bind"] == dict(bind)]
        if not mine:
            continue
        free = _free_port(int(bind["port"]), held, {int(x["port"]) for x in binds})
        example = f", e.g. -e '{{\"{bind['knob']}\": {free}}}' (free now)" if free else ""
        holders = "; ".join(dict.fromkeys(f"{c['holder']} listening on {c['listener']}" for c in mine))
        hints = " and ".join(dict.fromkeys(c["hint"] for c in mine))
        lines.append(f"Port {bind['port']} on {bind['host']} ({bind['knob']}, where {bind['who']} will "
                     f"listen) is held by another service: {holders}. Fix: {hints}, or set {bind['knob']} "
                     f"to a free port{example}; nothing was changed.")
    return {"ok": False, "conflicts": conflicts, "ours": ours, "message": " ".join(lines)}

class FilterModule:
    def filters(self):
        return {"spark_port_binds": spark_port_binds, "spark_port_check": spark_port_check}
