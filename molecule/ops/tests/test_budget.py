"""The memory budget on the test host (runs before test_ops.py): a "desktop" holding its share, a stand-in
that reserves its utilization of MemTotal at start as vLLM does, and the real earlyoom at the budget's lines.

The default deploy keeps serving; a utilization that leaves too little is refused before anything starts;
an ops stage whose guard stops the server fails loudly. Figures (host_vars/spark-ops.yml): MemTotal 2048
MiB, the server 0.25 (512 MiB), the desktop 384 MiB, the guard's lines 128 / 64 MiB, the margin 192 MiB.
"""

from __future__ import annotations

import re

from host_probe import healthy, wait_until
from playbook_runner import run_playbook

PORT = 18471
UNIT = "sparkllm-vllm-baseline.service"
CONTAINER = "molops-vllm-baseline"
RESERVED_MIB = 512  # 0.25 x 2048 MiB
DESKTOP_MIB = 384
TERM_MIB, KILL_MIB = 128, 64


def _rss_mib(host, pid: str) -> int:
    return int(host.check_output(f"awk '/VmRSS/ {{print int($2 / 1024)}}' /proc/{pid}/status"))


def _avail_mib(host) -> int:
    return int(host.check_output("awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo"))


def _flat(text: str) -> str:
    """Ansible's output with its line folding undone."""
    return " ".join(text.split())


def _kills(host, since: str = "") -> int:
    log = host.check_output(f"journalctl --no-pager -o cat -t earlyoom {since}")
    return len(re.findall(r"sending SIG(?:TERM|KILL) to process", log))


def test_the_default_deploy_keeps_serving_beside_the_desktop(host):
    # the box booted into its desktop: graphical.target active, the shell holding its share
    active = host.check_output("systemctl is-active graphical.target display-manager.service")
    assert active.split() == ["active", "active"], active
    shell = host.check_output("pgrep -x gnome-shell")
    assert _rss_mib(host, shell) >= DESKTOP_MIB
    # the server reserved 0.25 x MemTotal at start, as vLLM does, and is resident
    pid = host.check_output("pgrep -x vllm")
    assert _rss_mib(host, pid) >= RESERVED_MIB
    assert f"stand-in: reserved {RESERVED_MIB} MiB (gpu_memory_utilization=0.25" in \
        host.check_output(f"journalctl --no-pager -o cat -u {UNIT}")
    # earlyoom at the budget's absolute lines (128 MiB of 2048 = 6.25 %), and it never acted
    log = host.check_output("journalctl --no-pager -o cat -u earlyoom.service")
    assert "sending SIGTERM when mem <=  6.25% and swap <= 100.00%" in log, log[-2000:]
    assert "-M 131072,65536" in host.file("/etc/default/earlyoom").content_string
    assert _kills(host) == 0
    assert host.check_output(f"systemctl show -p NRestarts --value {UNIT}") == "0"
    assert healthy(host, PORT)
    avail = _avail_mib(host)
    assert avail > TERM_MIB + 100, avail
    print(f"\nBUDGET FIGURE: default deploy serving; MemAvailable {avail} MiB beside the desktop "
          f"({_rss_mib(host, shell)} MiB) and the server ({_rss_mib(host, pid)} MiB); "
          f"guard line {TERM_MIB} MiB")


def test_a_utilization_that_leaves_too_little_is_refused_before_anything_starts(host):
    host.check_output(f"systemctl stop {UNIT}")
    wait_until(lambda: not host.service(UNIT).is_running, 30, f"{UNIT} to stop")
    try:
        t0 = host.check_output("date +%s")
        res = run_playbook("molecule/ops/converge.yml", {"vllm_gpu_memory_utilization": 0.7})
        assert res.rc != 0, res.output[-3000:]
        m = re.search(r"memory budget of spark-ops: vllm_gpu_memory_utilization=0.7 reserves 1.4 GiB of "
                      r"2.0 GiB \(MemTotal\); with [\d.]+ GiB in use before vLLM starts "
                      r"\(graphical.target is active\), ([\d.-]+) GiB is left.*?0.3 GiB required; refused: "
                      r"lower vllm_gpu_memory_utilization to (0\.\d\d) or less or boot to multi-user.target",
                      _flat(res.output))
        assert m, res.output[-3000:]
        assert 0.25 <= float(m.group(2)) < 0.7 and float(m.group(1)) < 0.3
        # nothing was started: no unit start, no container
        assert not host.service(UNIT).is_running
        assert host.run(f"docker inspect {CONTAINER}").rc != 0
        assert "Started" not in host.check_output(f"journalctl --no-pager -o cat -u {UNIT} --since @{t0}")
        print(f"\nBUDGET FIGURE: 0.7 refused with {m.group(1)} GiB left; preflight prints {m.group(2)}")
    finally:
        host.check_output(f"systemctl start {UNIT}")
    wait_until(lambda: healthy(host, PORT), 60, "the server's /health again")


def test_an_ops_stage_whose_guard_stops_the_server_fails_loudly(host):
    assert healthy(host, PORT)
    # a SIGTERM line above what the box keeps: earlyoom stops the server as soon as it starts with it
    line = (_avail_mib(host) + 64) << 20
    t0 = host.check_output("date +%s")
    res = run_playbook("playbooks/ops.yml", {"spark_memory_guard_term_bytes": line,
                                             "spark_memory_guard_kill_bytes": KILL_MIB << 20,
                                             "spark_stage_force": True, "spark_ops_watchdog_enabled": False})
    try:
        assert res.rc != 0, res.output[-3000:]
        want = (rf"{UNIT} does not serve after the ops stage \(unit \w+, /health \S+, the memory guard "
                r"killed a process\): the box cannot keep the memory guard line")
        assert re.search(want, _flat(res.output)), res.output[-3000:]
        assert _kills(host, f"--since @{t0}") == 1
        assert not host.service(UNIT).is_running
    finally:
        # the budget's own lines again before the server starts (the high line would stop it again), then the
        # whole stage with its check, the server serving
        restore = run_playbook("playbooks/ops.yml",
                               {"spark_stage_force": True, "spark_ops_check_server": False})
        assert restore.rc == 0, restore.output[-3000:]
        host.check_output(f"systemctl start {UNIT}")
        wait_until(lambda: healthy(host, PORT), 60, "the server's /health again")
        pid = host.check_output("pgrep -x vllm")
        again = run_playbook("playbooks/ops.yml", {"spark_stage_force": True})
    assert again.rc == 0, again.output[-3000:]
    assert "-M 131072,65536" in host.file("/etc/default/earlyoom").content_string
    assert host.check_output("pgrep -x vllm") == pid and healthy(host, PORT)
