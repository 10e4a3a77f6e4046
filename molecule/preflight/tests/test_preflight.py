"""Behaviour of the preflight stage on the systemd test host."""

import json
import re
import time

import pytest
from playbook_runner import run_playbook, run_playbook_raw_e

FACT = "/etc/ansible/facts.d/spark_preflight.fact"
METHODS = ["baseline", "ngram", "mtp", "eagle3", "dflash"]


def _fact(host):
    return json.loads(host.file(FACT).content_string)


def test_fact_records_what_was_found(host):
    fact = _fact(host)
    assert fact["testbed"] is True
    assert fact["gpu_checks"] == "skipped (test bed)"
    assert fact["docker_version"]  # the machine's real engine answered through the mounted socket
    assert fact["nvidia_runtime"] in (True, False)
    assert fact["memtotal_gib"] > 0
    assert fact["model_filesystem"].startswith("/")
    assert fact["architecture"] == host.system_info.arch
    assert [(b["host"], b["port"]) for b in fact["api_port"]["binds"]] == [("127.0.0.1", 8000)]


def test_fact_is_root_owned_and_readable(host):
    f = host.file(FACT)
    assert f.user == "root"
    assert f.mode == 0o644


def test_systemd_is_pid1(host):
    assert host.run("systemctl is-system-running --wait").stdout.strip() in ("running", "degraded")


def test_unknown_method_is_rejected_quickly_and_changes_nothing(host):
    before = host.file(FACT).mtime
    start = time.monotonic()
    res = run_playbook_raw_e("site.yml", "spec_method=bogus")
    assert res.rc != 0
    assert time.monotonic() - start < 120
    assert "spec_method" in res.output and "bogus" in res.output
    for m in METHODS:
        assert m in res.output
    assert "TASK [preflight" not in res.output
    assert host.file(FACT).mtime == before


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("spec_num_speculative_tokens=two", "spec_num_speculative_tokens"),
        ("spec_num_speculative_tokens=2", "spec_num_speculative_tokens"),
        ("preflight_testbed=false", "preflight_testbed must be a boolean"),
        ("vllm_gpu_memory_utilization=0.99", "vllm_gpu_memory_utilization"),
    ],
)
def test_wrong_types_and_ranges_are_named(raw, needle):
    res = run_playbook_raw_e("site.yml", raw, tags="preflight")
    assert res.rc != 0
    assert needle in res.output
    assert "TASK [preflight" not in res.output


# Misspelt on purpose (tests/unit/test_spark_knobs.py leaves the names of MISSPELT out of its scan of
# the scenarios' own variables): typo -> the knob meant.
MISSPELT = {
    "spec_methd": "spec_method",
    "spec_num_speculativ_tokens": "spec_num_speculative_tokens",
    "vllm_gpu_memory_utilisation": "vllm_gpu_memory_utilization",
}


@pytest.mark.parametrize(
    ("raw", "needle"),
    [(f"{typo}=1", f"{typo} is not a variable of this toolkit (did you mean {meant}?)")
     for typo, meant in MISSPELT.items()],
)
def test_misspelt_knob_is_refused_with_the_closest_name(raw, needle):
    res = run_playbook_raw_e("site.yml", raw, tags="preflight")
    assert res.rc != 0
    assert needle in res.output
    assert "spark_knobs_allowed" in res.output
    assert "TASK [preflight" not in res.output


def test_owners_own_variable_passes_when_listed():
    res = run_playbook("site.yml", {"spark_knobs_allowed": ["spark_site_*"], "spark_site_label": "lab"},
                       tags="preflight")
    assert res.rc == 0, res.output[-2000:]


def test_misspelt_tag_is_refused_naming_the_stage_tags(host):
    before = host.file(FACT).mtime
    res = run_playbook("site.yml", tags="serv")
    assert res.rc != 0
    assert "--tags serv: no play or task has this tag (did you mean serve?)" in res.output
    assert "the stage tags are preflight, model, build, cluster, serve, ops, monitoring, bench" in res.output
    assert "TASK [preflight" not in res.output
    assert host.file(FACT).mtime == before


def test_eagle3_without_drafter_is_rejected():
    res = run_playbook("site.yml", {"spec_method": "eagle3"}, tags="preflight")
    assert res.rc != 0
    assert "spec_eagle3_drafter" in res.output


def test_not_a_spark_is_refused_with_a_way_out():
    res = run_playbook("site.yml", {"preflight_testbed": False}, tags="preflight")
    assert res.rc != 0
    assert "is not a DGX Spark" in res.output
    assert "inventory/examples/remote-spark.yml" in res.output
    assert "make demo" in res.output
    assert "preflight_testbed" not in res.output  # a test bed still fails on memory: not a way out


def test_disk_shortage_names_need_and_fix():
    res = run_playbook("site.yml", {"preflight_disk_margin_bytes": 10**18}, tags="preflight")
    assert res.rc != 0
    assert "Not enough disk" in res.output
    assert "spark_model_root" in res.output


def test_docker_data_root_shortage_names_need_and_fix():
    res = run_playbook("site.yml", {"preflight_docker_image_bytes": 10**18}, tags="preflight")
    assert res.rc != 0
    assert "Not enough disk for Docker's data root" in res.output
    assert "data-root" in res.output and "docker image prune" in res.output


def test_too_little_memory_is_refused():
    res = run_playbook("site.yml", {"preflight_min_memory_gib": 100000}, tags="preflight")
    assert res.rc != 0
    assert "128 GB Spark" in res.output


# A second listener on the API port (a port no other test uses, so the stage gate runs the stage): refused in
# preflight naming the port, the process and the fix, before any later stage; the fact is not rewritten.
HELD_PORT = 8123


@pytest.fixture
def held_port(host):
    listing = host.check_output(
        f"setsid -f python3 -m http.server {HELD_PORT} --bind 0.0.0.0 >/dev/null 2>&1; sleep 1; "
        f"ss -Hltnp 'sport = :{HELD_PORT}'")
    pids = re.findall(r'"python3",pid=(\d+)', listing)
    assert pids, listing
    yield HELD_PORT
    host.run(f"kill {pids[0]}")


def test_a_port_another_service_holds_is_refused_naming_it_and_the_fix(host, held_port):
    before = host.file(FACT).mtime
    res = run_playbook("site.yml", {"vllm_port": held_port}, tags="preflight")
    assert res.rc == 2, res.output[-3000:]
    out = " ".join(res.output.split())  # the callback folds a long message over lines
    assert (f"Port {held_port} on 127.0.0.1 (vllm_port, where vLLM will listen) is held by another service: "
            f"python3 (pid ") in out
    assert f"listening on 0.0.0.0:{held_port}" in out
    assert "set vllm_port to a free port" in out
    assert "TASK [preflight : Refuse a port another service holds]" in out
    assert host.file(FACT).mtime == before


# ---- the driver: a fake nvidia-smi stands in for a GB10 with a given driver (the last tests: they
# rewrite the fact with the GPU checks run)

FAKE_SMI = "/usr/local/bin/nvidia-smi"
GPU_RUN = {"preflight_testbed": False, "preflight_require_docker": False}


@pytest.fixture
def fake_gb10(host):
    def install(driver: str) -> None:
        script = (
            "#!/bin/sh\n"
            'case "$1" in\n'
            f'  --query-gpu=*) echo "NVIDIA GB10, 12.1, {driver}" ;;\n'
            f'  *) echo "| NVIDIA-SMI {driver}  Driver Version: {driver}  CUDA Version: 13.1 |" ;;\n'
            "esac\n"
        )
        res = host.run(f"cat > {FAKE_SMI} <<'EOF'\n{script}EOF\nchmod 0755 {FAKE_SMI}")
        assert res.rc == 0, res.stderr
        assert driver in host.check_output(f"{FAKE_SMI} --query-gpu=name,compute_cap,driver_version")
    yield install
    host.run(f"rm -f {FAKE_SMI}")


def test_driver_590_is_refused_naming_the_driver_and_the_fix(host, fake_gb10):
    fake_gb10("590.44.01")
    res = run_playbook("site.yml", GPU_RUN, tags="preflight")
    assert res.rc != 0
    assert "Driver 590.44.01 found" in res.output
    assert "580.x" in res.output and "deadlocks in CUDA-graph capture" in res.output
    assert "spark_bad_driver_enforce_eager" in res.output  # the opt-in is named


def test_driver_590_with_the_opt_in_passes_with_a_warning_and_records_eager(host, fake_gb10):
    fake_gb10("590.44.01")
    res = run_playbook("site.yml", {**GPU_RUN, "spark_bad_driver_enforce_eager": True}, tags="preflight")
    assert res.rc == 0, res.output[-3000:]
    assert "WARNING: driver 590.44.01 is on a branch that deadlocks CUDA-graph capture" in res.output
    assert "--enforce-eager" in res.output
    fact = _fact(host)
    assert fact["driver"] == "590.44.01" and fact["gpu_checks"] == "passed"
    assert fact["driver_bad_branch"] is True and fact["enforce_eager"] is True
    assert any("590.44.01" in w and "--enforce-eager" in w for w in fact["warnings"])


def test_driver_580_passes_without_a_driver_warning(host, fake_gb10):
    fake_gb10("580.95.05")
    res = run_playbook("site.yml", GPU_RUN, tags="preflight")
    assert res.rc == 0, res.output[-3000:]
    fact = _fact(host)
    assert fact["driver"] == "580.95.05"
    assert fact["driver_bad_branch"] is False and fact["enforce_eager"] is False
    assert not any("driver" in w for w in fact["warnings"])
