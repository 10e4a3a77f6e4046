"""The memory guard's files as the role renders them (role spark_ops, issue 24): earlyoom's arguments
and the hook it runs after a kill. The hook is run for real with stand-ins for logger and systemctl;
molecule/ops runs the whole guard against a real memory hog."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml
from spark_memory import spark_memory_guard_kib

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "spark_ops"
UNIT = "sparkllm-vllm-mtp.service"


def role_vars(ray: bool = False, **over) -> dict:
    v = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    derived = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    # the default's choice by mode (vars/main.yml): one Spark, or a node of a Ray cluster (head or worker)
    assert "_spark_ops_prefer_ray if _spark_ops_ray" in v["spark_ops_guard_prefer"]
    v["spark_ops_guard_prefer"] = derived["_spark_ops_prefer_ray" if ray else "_spark_ops_prefer_server"]
    # the budget's lines (group_vars/all/memory.yml) on a 128 GB Spark's MemTotal, as the default's filter
    # makes them
    budget = yaml.safe_load((ROOT / "group_vars" / "all" / "memory.yml").read_text())
    v["spark_ops_guard_mem_kib"] = spark_memory_guard_kib(
        budget["spark_memory_guard_term_bytes"], budget["spark_memory_guard_kill_bytes"], 125_519_668 * 1024)
    v.update(ansible_managed="Ansible managed", spark_ops_unit=UNIT,
             spark_ops_libexec_dir="/usr/local/libexec/sparkllm")
    v.update(over)
    return v


def render(name: str, ray: bool = False, **over) -> str:
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    return env.from_string((ROLE / "templates" / name).read_text()).render(**role_vars(ray, **over))


def earlyoom_argv(ray: bool = False) -> list[str]:
    line = next(x for x in render("earlyoom.default.j2", ray).splitlines() if x.startswith("EARLYOOM_ARGS="))
    # systemd's `ExecStart=/usr/bin/earlyoom $EARLYOOM_ARGS`: the value unquoted, split at whitespace
    return shlex.split(line.split("=", 1)[1])[0].split()


def test_earlyoom_gets_the_thresholds_victims_and_hook() -> None:
    argv = earlyoom_argv()
    opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("-") and argv[i] != "-p"}
    # absolute lines in KiB (3 GiB / 1.5 GiB), no percentage: -m would win where it is lower
    assert opt["-M"] == "3145728,1572864" and "-m" not in opt and opt["-s"] == "100,100"
    assert opt["-N"] == "/usr/local/libexec/sparkllm/oom-hook"
    prefer, avoid = re.compile(opt["--prefer"]), re.compile(opt["--avoid"])
    # vLLM's process names: its console script, and the setproctitle titles (comm keeps 15 characters)
    for comm in ("vllm", "VLLM::EngineCor", "VLLM::Worker_TP0"):
        assert prefer.search(comm), comm
    # a notebook or any other Python is not the server
    for comm in ("python3", "python3.12", "jupyter-lab", "myvllmtool"):
        assert not prefer.search(comm), comm
    for comm in ("sshd", "systemd", "systemd-journal", "dockerd", "containerd-shim-runc-v2", "earlyoom"):
        assert avoid.search(comm), comm
    assert not avoid.search("vllm")


def test_with_ray_the_guard_prefers_the_ray_actors_that_hold_the_gpu() -> None:
    """vLLM's Ray executor places RayWorkerWrapper actors on every node's GPU (0.19.1
    v1/executor/ray_executor.py); Ray titles an actor's process ray::<class> (ray::<class>.<method> while one
    runs), comm cut to 15 characters. molecule/cluster checks the comm of a real Ray actor of that class on
    the worker against this rule."""
    argv = earlyoom_argv(ray=True)
    prefer = re.compile(argv[argv.index("--prefer") + 1])
    for comm in ("ray::RayWorkerW", "VLLM::EngineCor", "vllm"):
        assert prefer.search(comm), comm
    # Ray's own daemons and idle workers hold no GPU; killing the raylet or GCS ends the whole node
    for comm in ("raylet", "gcs_server", "ray::IDLE", "ray::JobSupervi", "python3", "ray"):
        assert not prefer.search(comm), comm
    assert not re.compile(earlyoom_argv()[earlyoom_argv().index("--prefer") + 1]).search("ray::RayWorkerW")


def test_earlyoom_runs_as_root_so_its_hook_may_stop_the_unit() -> None:
    text = render("earlyoom-sparkllm.conf.j2")
    assert re.search(r"^\[Service\]\nDynamicUser=no$", text, re.M), text


@pytest.fixture
def hook(tmp_path: Path):
    """The rendered hook with logger and systemctl replaced by scripts that record their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("logger", "systemctl"):
        f = bin_dir / tool
        f.write_text(f'#!/bin/sh\necho "{tool} $*" >> {tmp_path}/calls\n')
        f.chmod(0o755)

    def run(name: str, ray: bool = False, **over) -> list[str]:
        script = tmp_path / "oom-hook"
        state = {"spark_ops_state_dir": str(tmp_path / "state")}
        script.write_text(render("oom-hook.j2", ray, **{**state, **over}))
        script.chmod(0o755)
        env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", EARLYOOM_PID="4242", EARLYOOM_UID="0",
                   EARLYOOM_NAME=name)
        (tmp_path / "calls").unlink(missing_ok=True)
        assert subprocess.run([str(script)], env=env, check=False).returncode == 0
        return (tmp_path / "calls").read_text().splitlines()

    return run


def test_the_hook_stops_the_unit_when_the_server_was_killed(hook) -> None:
    calls = hook("VLLM::EngineCor")
    line = "earlyoom killed pid 4242 (VLLM::EngineCor): MemAvailable fell to the guard's line (3072 MiB)"
    assert any(line in c for c in calls), calls
    assert any(f"stopping {UNIT} (memory guard)" in c and f"systemctl start {UNIT}" in c
               for c in calls), calls
    assert calls[-1] == f"systemctl stop --no-block {UNIT}"


def test_on_a_ray_worker_the_hook_stops_its_ray_node(hook) -> None:
    """A worker's unit is its Ray node: restarted, it would take the head's actors back into the shortage."""
    calls = hook("ray::RayWorkerW", ray=True, spark_ops_unit="sparkllm-ray-worker.service")
    assert calls[-1] == "systemctl stop --no-block sparkllm-ray-worker.service", calls
    assert not any(c.startswith("systemctl") for c in hook("raylet", ray=True))


def test_the_hook_leaves_the_unit_alone_when_something_else_was_killed(hook) -> None:
    calls = hook("python3")
    assert len(calls) == 1 and "earlyoom killed pid 4242 (python3)" in calls[0], calls
    assert not any(c.startswith("systemctl") for c in calls)


def test_the_hook_only_logs_when_told_not_to_stop(hook) -> None:
    calls = hook("vllm", spark_ops_guard_stop_unit=False)
    assert not any(c.startswith("systemctl") for c in calls)
    assert any("left to its Restart= policy" in c for c in calls), calls


def test_each_kill_is_a_line_the_exporter_counts(hook, tmp_path: Path) -> None:
    """The hook appends "<unix time> <pid> <name>" to guard-kills.log, readable by the exporter (DynamicUser),
    whose sparkllm_guard_kills_total feeds the MemoryGuardKill alert."""
    import gb10_exporter

    hook("VLLM::EngineCor")
    hook("python3")
    log = tmp_path / "state" / "guard-kills.log"
    lines = log.read_text().splitlines()
    assert [ln.split(" ", 2)[1:] for ln in lines] == [["4242", "VLLM::EngineCor"], ["4242", "python3"]]
    assert log.stat().st_mode & 0o777 == 0o644
    assert "sparkllm_guard_kills_total 2" in "\n".join(gb10_exporter.ops_metrics(tmp_path / "state"))


def test_a_workers_watchdog_unit_judges_its_ray_node() -> None:
    """The worker's watchdog runs in Ray-node mode (no API there) and its argv is one the script accepts."""
    import ops_watchdog

    text = render("sparkllm-watchdog.service.j2", ray=True, spark_ops_unit="sparkllm-ray-worker.service",
                  _spark_ops_watch="ray_node", _spark_ops_ray_agent_url="http://127.0.0.1:52365",
                  _spark_ops_ray_head="192.168.100.10:6379", spark_ops_state_dir="/var/lib/sparkllm-ops",
                  spark_ops_watchdog_grace="120")
    (line,) = [x for x in text.splitlines() if x.startswith("ExecStart=")]
    argv = shlex.split(line.split("=", 1)[1])
    assert argv[:2] == ["/usr/bin/python3", "/usr/local/libexec/sparkllm/ops_watchdog.py"]
    a = ops_watchdog.parse_args(argv[2:])
    assert (a.unit, a.ray_node, a.ray_head, a.url) == ("sparkllm-ray-worker.service", "http://127.0.0.1:52365",
                                                       "192.168.100.10:6379", None)
    assert a.grace == 120 and a.timer == "sparkllm-watchdog.timer"
