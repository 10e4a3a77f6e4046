"""The ops stage on the systemd test host: the memory guard and the health watchdog acting for real.

Order matters (every test takes the ``host`` fixture so pytest keeps file order): the guard first
(a memory hog, the server stopped), then the server started again, a wedge healed by one restart,
and a wedge that stays, which ends in the watchdog's failed state.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from host_probe import healthy, host_now, invocation, journal, wait_until
from playbook_runner import PROJECT

PORT = 18471
UNIT = "sparkllm-vllm-baseline.service"
CONTAINER = "molops-vllm-baseline"
WEDGE = "/var/tmp/molecule-ops-wedge/on"  # /wedge/on in the server container (molecule.yml, host_vars)
HOLD_MIB = 512  # host_vars: the stand-in reserves 0.25 x 2048 MiB at start


def _meminfo_mib(host, field: str) -> int:
    return int(host.check_output(f"awk '/^{field}:/ {{print int($2 / 1024)}}' /proc/meminfo"))


def _ping() -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(PROJECT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0")
    return subprocess.run(["ansible", "-i", os.environ["MOLECULE_INVENTORY_FILE"], "spark-ops",
                           "-m", "ansible.builtin.ping"], cwd=PROJECT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_guard_sees_the_test_hosts_limit_and_the_server(host):
    # earlyoom reads /proc/meminfo: the cgroup's 2 GiB, not the machine's memory
    log = host.check_output("journalctl --no-pager -o cat -u earlyoom.service")
    assert re.search(r"mem total:\s+2048 MiB", log), log[-2000:]
    assert "sending SIGTERM when mem <=  6.25% and swap <= 100.00%" in log  # 128 MiB (host_vars)
    assert "Preferring to kill process names that match regex '^(vllm|VLLM::.*)$'" in log
    # the drop-in: root, so the hook's systemctl works
    assert host.check_output("systemctl show -p DynamicUser --value earlyoom.service") == "no"
    # the server's process is in the test host's PID namespace, named as vLLM's is, and its memory
    # is charged to the test host's cgroup
    pid = host.check_output("pgrep -x vllm")
    assert pid.isdigit(), pid
    assert int(host.check_output(f"awk '/VmRSS/ {{print int($2 / 1024)}}' /proc/{pid}/status")) >= HOLD_MIB
    mem = "awk -F: '$2 ~ /(^|,)memory(,|$)/' /proc/{}/cgroup"
    cgroup = host.check_output(mem.format(pid))
    own = host.check_output(mem.format(1)).split(":", 2)[2]
    assert cgroup.split(":", 2)[2].startswith(own.removesuffix("/init.scope") + "/"), (cgroup, own)


def test_a_memory_hog_gets_the_server_stopped_and_the_box_stays_up(host):
    assert host.service(UNIT).is_running and healthy(host, PORT)
    t0 = host_now(host)
    avail = _meminfo_mib(host, "MemAvailable")
    # grow until MemAvailable would sit at ~80 MiB: below the SIGTERM line (128 MiB), above SIGKILL's
    # (64 MiB); 8 MiB every 0.1 s, so earlyoom (polling every 100 ms this close) acts on the way down
    cap = avail - 80
    assert cap > HOLD_MIB, f"the test host has {avail} MiB available; the hog needs more than the server"
    host.check_output(f"systemd-run --unit ops-hog --collect /usr/bin/python3 /usr/local/bin/ops-hog {cap}")
    try:
        wait_until(lambda: not host.service(UNIT).is_running, 90, f"the guard to stop {UNIT}")
        log = journal(host, t0, "-t", "earlyoom", "-t", "sparkllm-memory-guard")  # earlyoom and its hook
        kill = re.search(r'sending SIG(TERM|KILL) to process (\d+) uid \d+ "([^"]+)"', log)
        assert kill and kill.group(3) == "vllm", log
        assert len(re.findall(r"sending SIG(?:TERM|KILL) to process", log)) == 1, log  # the hog was spared
        assert f"killed pid {kill.group(2)} (vllm): MemAvailable fell to the guard's line (128 MiB)" in log, \
            log
        assert f"stopping {UNIT} (memory guard)" in log and f"systemctl start {UNIT}" in log, log
        # the hog, the bigger process, lives on; the server's memory came back
        assert host.service("ops-hog.service").is_running
        hog_rss = int(host.check_output(
            "awk '/VmRSS/ {print int($2 / 1024)}' /proc/$(systemctl show -p MainPID --value ops-hog)/status"))
        assert hog_rss > HOLD_MIB, hog_rss
        avail_line = re.search(r"mem avail:.*?\)", log)
        print(f"\nGUARD FIGURE: {avail_line.group(0) if avail_line else '?'}; {kill.group(0)}; "
              f"stopped {host_now(host) - t0} s after the hog started; hog spared at {hog_rss} MiB")
        assert wait_until(lambda: _meminfo_mib(host, "MemAvailable") > 128 + HOLD_MIB // 2, 10,
                          "the server's memory to come back")
        # the box answers Ansible, and nothing brings the server back into the shortage
        ping = _ping()
        assert ping.returncode == 0 and re.search(r"SUCCESS.*\bping\W+pong", ping.stdout, re.S), \
            ping.stdout + ping.stderr
        time.sleep(6)  # three times the unit's RestartSec
        assert not host.service(UNIT).is_running
        assert host.run(f"docker inspect {CONTAINER}").rc != 0
    finally:
        host.run("systemctl stop ops-hog.service")


def test_the_server_starts_again_once_memory_is_back(host):
    host.check_output(f"systemctl start {UNIT}")
    wait_until(lambda: healthy(host, PORT), 60, "the restarted server's /health")


def test_a_wedged_server_is_restarted_after_two_failed_probes(host):
    before = invocation(host, UNIT)
    pid = host.check_output("pgrep -x vllm")
    t0 = host_now(host)
    host.check_output(f"touch {WEDGE}")
    try:
        # the process lives on and accepts connections, /health does not answer
        assert host.run(f"curl -s --max-time 2 http://127.0.0.1:{PORT}/health").rc == 28
        assert host.check_output("pgrep -x vllm") == pid
        wait_until(lambda: "restarting after 2 failed probes" in journal(host, t0, "-t", "sparkllm-watchdog"),
                   45, "the watchdog's restart")
        # the line comes before its `systemctl restart` stops the old process: keep the wedge until the unit
        # is a new invocation, or the old process answers /health again and the restart lands in the next test
        wait_until(lambda: invocation(host, UNIT) != before, 30, "the unit's new invocation")
    finally:
        host.check_output(f"rm -f {WEDGE}")
    log = journal(host, t0, "-t", "sparkllm-watchdog")
    assert re.search(rf"{UNIT}: probe failed \(1/2\): no answer \(TimeoutError", log), log
    assert f"{UNIT}: restarting after 2 failed probes (restart 1 of 2 allowed within 600s)" in log, log
    wait_until(lambda: healthy(host, PORT), 60, "the restarted server's /health")
    print(f"\nWATCHDOG FIGURE: wedged -> restarted -> healthy again in {host_now(host) - t0} s")
    assert invocation(host, UNIT) != before
    assert host.check_output("pgrep -x vllm") != pid


def test_a_server_that_stays_wedged_ends_in_a_clear_failed_state(host):
    t0 = host_now(host)
    host.check_output(f"touch {WEDGE}")
    try:
        wait_until(lambda: "GAVE UP" in journal(host, t0, "-t", "sparkllm-watchdog"), 90,
                   "the watchdog to give up")
        log = journal(host, t0, "-t", "sparkllm-watchdog")
        # one more restart (the second of two allowed), then the wedged new start is judged after its grace
        assert log.count("restarting after 2 failed probes") == 1, log
        assert "still loading" in log, log
        assert re.search(rf"{UNIT}: GAVE UP: unhealthy again after 2 restarts within 600s; stopping it and "
                         r"sparkllm-watchdog.timer .*systemctl reset-failed sparkllm-watchdog.service; "
                         rf"systemctl start {UNIT} sparkllm-watchdog.timer", log), log
        wait_until(lambda: not host.service(UNIT).is_running, 30, f"{UNIT} to stop")
        print(f"\nWATCHDOG FIGURE: wedged for good -> gave up after {host_now(host) - t0} s")
        assert host.run("systemctl is-failed sparkllm-watchdog.service").stdout.strip() == "failed"
        assert host.run("systemctl is-active sparkllm-watchdog.timer").stdout.strip() == "inactive"
        # no restart storm: nothing starts the server again
        t1 = host_now(host)
        time.sleep(8)
        assert not host.service(UNIT).is_running
        assert "restarting" not in journal(host, t1, "-t", "sparkllm-watchdog")
        state = json.loads(host.file("/var/lib/sparkllm-ops/watchdog.json").content_string)
        assert state["gave_up"] > 0 and len(state["restarts"]) == 2
    finally:
        host.check_output(f"rm -f {WEDGE}")
