"""The API's port checked in preflight (filter_plugins/spark_ports.py, roles/preflight/tasks/port.yml):
another service's listener is refused naming the port, the process, its unit and the fix; this toolkit's own
server or proxy passes (a rerun of a deployed Spark)."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pytest
import yaml
from spark_ports import (
    PortCheckError,
    parse_ps_units,
    parse_ss_listeners,
    serve_uses_proxy,
    spark_port_binds,
    spark_port_check,
)

ROOT = Path(__file__).resolve().parents[2]
UNITS = [f"sparkllm-vllm-{m}.service" for m in ("baseline", "ngram", "mtp", "eagle3", "dflash")]
NONE_RUN = ["inactive"] * len(UNITS)
MTP_RUNS = ["inactive", "inactive", "active", "inactive", "inactive"]

# ss -Hltnp as iproute2 6.1 prints it (the address forms measured with python3 listeners: 0.0.0.0, [::] with
# IPV6_V6ONLY, * without it, [::1], an interface suffix)
RESOLVED = 'LISTEN 0      4096   127.0.0.53%lo:53   0.0.0.0:*    users:(("systemd-resolve",pid=501,fd=14))'
SSHD = 'LISTEN 0      128          0.0.0.0:22        0.0.0.0:*    users:(("sshd",pid=900,fd=3))'
NGINX_ALL = ('LISTEN 0      511          0.0.0.0:8000      0.0.0.0:*    '
             'users:(("nginx",pid=812,fd=6),("nginx",pid=813,fd=6),("nginx",pid=811,fd=6))')
NGINX_V6 = 'LISTEN 0      511             [::]:8000         [::]:*    users:(("nginx",pid=812,fd=7))'
VLLM_LOOP = 'LISTEN 0      2048       127.0.0.1:8000      0.0.0.0:*    users:(("vllm",pid=4242,fd=27))'
VLLM_UP = 'LISTEN 0      2048       127.0.0.1:18000     0.0.0.0:*    users:(("vllm",pid=4242,fd=27))'
JUPYTER_ANY = 'LISTEN 0      128                *:8000       *:*    users:(("jupyter-lab",pid=3100,fd=5))'
PS = ("  811 nginx.service\n  812 nginx.service\n  813 nginx.service\n 3100 jupyter.service\n"
      " 4242 docker-ab12.scope\n")


def check(*lines: str, host="127.0.0.1", port=8000, upstream=18000, states=NONE_RUN, proxy_site=False,
          ps=PS):
    binds = spark_port_binds(host, port, upstream)
    return spark_port_check("\n".join(lines), binds, UNITS, states, proxy_site, ps)


def test_parse_ss_reads_address_port_and_every_process():
    out = parse_ss_listeners("State Recv-Q Send-Q Local Address:Port Peer Address:Port Process\n"
                             + "\n".join([RESOLVED, NGINX_ALL, NGINX_V6]))
    assert [(x["host"], x["port"]) for x in out] == [("127.0.0.53%lo", 53), ("0.0.0.0", 8000), ("[::]", 8000)]
    assert [p["pid"] for p in out[1]["processes"]] == [812, 813, 811]
    assert {p["name"] for p in out[1]["processes"]} == {"nginx"}
    # without root ss names no process: the listener still counts
    bare = parse_ss_listeners("LISTEN 0 128 0.0.0.0:8000 0.0.0.0:*")
    assert bare == [{"address": "0.0.0.0:8000", "host": "0.0.0.0", "port": 8000, "processes": []}]


def test_parse_ps_units_leaves_out_processes_without_a_unit():
    assert parse_ps_units("    1 init.scope\n    2 -\n  812 nginx.service\ngarbage\n") == {
        1: "init.scope", 812: "nginx.service"}


def test_a_free_port_passes():
    r = check(RESOLVED, SSHD)
    assert r["ok"] and r["conflicts"] == []
    assert r["message"] == "port check: 127.0.0.1:8000 free"


def test_another_service_on_every_address_is_refused_naming_port_process_unit_and_fix():
    r = check(SSHD, NGINX_ALL, NGINX_V6)
    assert not r["ok"]
    first = r["message"].split(". ")[0]
    assert first == ("Port 8000 on 127.0.0.1 (vllm_port, where vLLM will listen) is held by another service: "
                     "nginx (pids 812, 813, 811; nginx.service) listening on 0.0.0.0:8000")
    assert "sudo systemctl disable --now nginx.service" in r["message"]
    assert "set vllm_port to a free port, e.g. -e '{\"vllm_port\": 8001}' (free now)" in r["message"]
    assert r["message"].endswith("nothing was changed.")
    # [::]:8000 is IPv6 only: vLLM's 127.0.0.1 does not meet it
    assert [c["listener"] for c in r["conflicts"]] == ["0.0.0.0:8000"]


def test_the_suggested_port_is_one_nobody_listens_on():
    r = check(NGINX_ALL, NGINX_ALL.replace(":8000 ", ":8001 "), NGINX_ALL.replace(":8000 ", ":8002 "))
    assert "-e '{\"vllm_port\": 8003}'" in r["message"]


@pytest.mark.parametrize(
    ("listener", "host", "clash"),
    [
        (JUPYTER_ANY, "127.0.0.1", True),   # "*": both families
        (JUPYTER_ANY, "::1", True),
        (NGINX_V6, "0.0.0.0", False),       # [::] with IPV6_V6ONLY leaves IPv4 alone
        (NGINX_V6, "::1", True),
        (NGINX_V6, "::", True),             # vLLM's "::" binds both families
        (NGINX_ALL, "::", True),
        (VLLM_LOOP, "0.0.0.0", True),       # a wildcard bind meets every address of its family
        (VLLM_LOOP, "localhost", True),     # vLLM resolves localhost to 127.0.0.1 (AF_INET)
        (VLLM_LOOP, "127.0.0.2", False),
        (VLLM_LOOP, "::1", False),
        ('LISTEN 0 5 [::ffff:127.0.0.1]:8000 *:* users:(("x",pid=7,fd=3))', "127.0.0.1", True),
        (VLLM_LOOP, "spark.lan", True),     # a name: any listener on the port may be it
    ],
)
def test_which_addresses_meet(listener, host, clash):
    binds = [{"who": "vLLM", "host": host, "port": 8000, "knob": "vllm_port"}]
    r = spark_port_check(listener, binds, UNITS, NONE_RUN, False, PS)
    assert r["ok"] is not clash, r["message"]


def test_a_port_held_by_a_different_port_number_is_not_a_clash():
    assert check(VLLM_UP, RESOLVED)["ok"]


def test_our_running_server_passes_a_rerun_of_a_deployed_spark():
    r = check(VLLM_LOOP, states=MTP_RUNS)
    assert r["ok"], r["message"]
    assert [o["listener"] for o in r["ours"]] == ["127.0.0.1:8000"]
    assert "held by this toolkit's server or proxy" in r["message"]
    # the same listener with none of our units running is a leftover: refused, its container named
    r = check(VLLM_LOOP)
    assert not r["ok"]
    assert "vllm (pid 4242; docker-ab12.scope) listening on 127.0.0.1:8000" in r["message"]
    assert "`docker ps`" in r["message"]


def test_behind_the_proxy_both_places_are_checked():
    binds = spark_port_binds("0.0.0.0", 8000, 18000)
    assert [(b["host"], b["port"], b["knob"]) for b in binds] == [
        ("127.0.0.1", 18000, "vllm_proxy_upstream_port"), ("0.0.0.0", 8000, "vllm_port")]
    # deployed with the proxy: nginx with our site, vLLM under its unit: passes
    r = check(NGINX_ALL, VLLM_UP, host="0.0.0.0", states=MTP_RUNS, proxy_site=True)
    assert r["ok"], r["message"]
    assert len(r["ours"]) == 2
    # the owner's nginx (no site of ours) on the LAN port: refused, naming vllm_port
    r = check(NGINX_ALL, VLLM_UP, host="0.0.0.0", states=MTP_RUNS, proxy_site=False)
    assert not r["ok"]
    assert r["message"].startswith("Port 8000 on 0.0.0.0 (vllm_port, where the LAN proxy (nginx) will "
                                   "listen)")
    # something else on the upstream port: refused, naming vllm_proxy_upstream_port
    r = check(JUPYTER_ANY.replace(":8000 ", ":18000 "), host="0.0.0.0")
    assert not r["ok"]
    assert r["message"].startswith("Port 18000 on 127.0.0.1 (vllm_proxy_upstream_port, where vLLM (behind")
    assert "jupyter.service" in r["message"] and "vllm_proxy_upstream_port" in r["message"].split("Fix:")[1]


def test_our_server_running_does_not_excuse_another_nginx():
    # our unit runs, but an nginx that is not our proxy holds the address the proxy needs
    r = check(NGINX_ALL, host="192.168.1.20", states=MTP_RUNS, proxy_site=False)
    assert not r["ok"]
    assert "nginx (pids 812, 813, 811; nginx.service)" in r["message"]


def test_a_listener_ss_cannot_name_is_still_refused():
    r = check("LISTEN 0 128 0.0.0.0:8000 0.0.0.0:*", ps="")
    assert not r["ok"]
    assert "a process ss does not name (run as root to see it)" in r["message"]
    assert "sudo ss -ltnp" in r["message"]


@pytest.mark.parametrize(("port", "upstream", "needle"),
                         [("eighty", 18000, "vllm_port='eighty' is not a port number"),
                          (0, 18000, "vllm_port=0 is out of range"),
                          (8000, 70000, "vllm_proxy_upstream_port=70000 is out of range")])
def test_bad_ports_are_named(port, upstream, needle):
    with pytest.raises(PortCheckError, match=re.escape(needle)):
        spark_port_binds("0.0.0.0", port, upstream)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "LOCALHOST", "::1", "[::1]",
                                  "0.0.0.0", "::", "192.168.1.20", "spark.lan", "1270.0.0.1"])
def test_the_proxy_rule_is_the_serve_roles(host):
    """serve_uses_proxy decides as roles/serve/vars/main.yml _serve_proxy does (rendered here)."""
    expr = yaml.safe_load((ROOT / "roles" / "serve" / "vars" / "main.yml").read_text())["_serve_proxy"]
    env = jinja2.Environment()
    env.tests["match"] = lambda value, pattern: re.match(pattern, value) is not None
    assert env.from_string(expr).render(vllm_host=host) == str(serve_uses_proxy(host))


def test_preflight_runs_the_check_before_recording_and_not_on_workers():
    tasks = yaml.safe_load((ROOT / "roles" / "preflight" / "tasks" / "main.yml").read_text())
    names = [t["ansible.builtin.include_tasks"] for t in tasks if "ansible.builtin.include_tasks" in t]
    assert names.index("port.yml") < names.index("facts.yml")
    step = next(t for t in tasks if t.get("ansible.builtin.include_tasks") == "port.yml")
    assert "spark_workers" in step["when"]
    port = (ROOT / "roles" / "preflight" / "tasks" / "port.yml").read_text()
    assert "spark_port_check" in port and "ss, -H, -l, -t, -n, -p" in port
