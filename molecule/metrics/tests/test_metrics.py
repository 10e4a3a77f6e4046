"""The monitoring stack on the test host: real Prometheus (Debian's package) with our configuration
scrapes the stand-in server, node exporter and the GB10 exporter; every panel query of the dashboards
in templates/grafana/dashboards/ returns data; everything listens on loopback; bad input is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from playbook_runner import PROJECT, run_playbook

sys.path.insert(0, str(PROJECT / "tests" / "harness"))
import grafana_check  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from registry_stub import RegistryStub  # noqa: E402

TESTINFRA_HOSTS = "ansible://spark-metrics"
EPHEMERAL = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"])
CONF = "/etc/sparkllm/monitoring"
DASHBOARDS = sorted((PROJECT / "templates" / "grafana" / "dashboards").glob("*.json"))


def _api(host, path: str) -> dict:
    fetch = "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=10).read().decode())"
    out = host.check_output(f"python3 -c '{fetch}' 'http://127.0.0.1:9090{path}'")
    return json.loads(out)


def test_every_scrape_target_is_up(host) -> None:
    targets = _api(host, "/api/v1/targets?state=active")["data"]["activeTargets"]
    health = {t["scrapePool"]: (t["health"], t["scrapeUrl"], t["lastError"]) for t in targets}
    assert set(health) == {"vllm", "node", "gb10", "prometheus"}, health
    assert all(h == "up" for h, _, _ in health.values()), health
    assert health["vllm"][1] == "http://127.0.0.1:8031/metrics"


def test_every_dashboard_panel_query_returns_data(host) -> None:
    """The queries are read from the dashboard JSON files the role deployed (the same as templates/)."""
    assert DASHBOARDS, "templates/grafana/dashboards/ holds no dashboard"
    for d in DASHBOARDS:
        assert host.file(f"{CONF}/grafana/dashboards/{d.name}").content_string == d.read_text()
    host.check_output("mkdir -p /opt/dashcheck")
    script = (PROJECT / "tests" / "harness" / "dashboard_queries.py").read_text()
    host.check_output(f"cat > /opt/dashcheck/dashboard_queries.py <<'PYEOF'\n{script}\nPYEOF")
    names = " ".join(f"{CONF}/grafana/dashboards/{d.name}" for d in DASHBOARDS)
    res = host.run("python3 /opt/dashcheck/dashboard_queries.py --prometheus http://127.0.0.1:9090 "
                   f"--rate-interval 20s --range-s 240 --step-s 4 --out /opt/dashcheck/results.json {names}")
    results = json.loads(host.file("/opt/dashcheck/results.json").content_string)
    (EPHEMERAL / "dashboard-results.json").write_text(json.dumps(results))
    print(res.stderr)
    assert res.rc == 0, res.stderr
    n_targets = sum(len(p["targets"]) for d in DASHBOARDS for p in json.loads(d.read_text())["panels"])
    assert len(results) == n_targets > 10
    by_title = {r["title"]: r for r in results}
    # ground truth of the stand-in (conditional acceptance 0.8 then 0.5): position 0 ~0.8, position 1 ~0.4
    per_pos = by_title["Acceptance per draft position"]["instant"]
    pos = {s["metric"]["position"]: float(s["value"][1]) for s in per_pos}
    assert set(pos) == {"0", "1"} and 0.6 < pos["0"] < 0.95 and pos["1"] < pos["0"], pos
    # the fake nvidia-smi prints 30..46 W
    power = float(by_title["GPU power"]["instant"][0]["value"][1])
    assert 30 <= power <= 47


def test_dashboard_png_from_the_same_queries(host) -> None:
    results = EPHEMERAL / "dashboard-results.json"
    assert results.is_file(), "test_every_dashboard_panel_query_returns_data runs first"
    out = EPHEMERAL / "spark-serving.png"
    proc = subprocess.run([sys.executable, str(PROJECT / "tests" / "harness" / "dashboard_png.py"),
                           str(results), str(out)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    keep = os.environ.get("SPARKLLM_DASHBOARD_PNG")  # where to keep a copy (docs/dashboards/ in the README)
    if keep:
        Path(keep).write_bytes(out.read_bytes())


def test_everything_listens_on_loopback_only(host) -> None:
    """/proc/net/tcp{,6}: the LISTEN sockets of Prometheus, node exporter and the GB10 exporter."""
    script = ("import sys\n"
              "for f in ('/proc/net/tcp', '/proc/net/tcp6'):\n"
              "    for line in open(f).read().splitlines()[1:]:\n"
              "        p = line.split()\n"
              "        if p[3] == '0A': print(p[1])\n")
    listening = host.check_output(f"python3 -c \"{script}\"").split()
    ports = {9090: [], 9100: [], 9835: []}
    for entry in listening:
        addr, port = entry.split(":")
        if int(port, 16) in ports:
            ports[int(port, 16)].append(addr)
    for port, addrs in ports.items():
        assert addrs, f"nothing listens on {port}"
        assert all(a == "0100007F" for a in addrs), f"port {port} on {addrs} (0100007F = 127.0.0.1)"


def test_promtool_accepts_our_configuration(host) -> None:
    res = host.run(f"promtool check config {CONF}/prometheus/prometheus.yml")
    assert res.rc == 0, res.stdout + res.stderr
    cmd = host.check_output("systemctl show -p ExecStart --value prometheus.service")
    assert f"--config.file={CONF}/prometheus/prometheus.yml" in cmd
    assert "--web.listen-address=127.0.0.1:9090" in cmd and "--storage.tsdb.retention.size=" in cmd


def test_grafana_provisioning_matches_grafanas_schema(host, tmp_path: Path) -> None:
    for rel in ("grafana/provisioning/datasources/sparkllm.yml",
                "grafana/provisioning/dashboards/sparkllm.yml",
                *(f"grafana/dashboards/{d.name}" for d in DASHBOARDS)):
        dest = tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(host.file(f"{CONF}/{rel}").content_string)
    assert grafana_check.check_dir(tmp_path / "grafana") == []


def test_gb10_exporter_reads_na_memory_from_meminfo(host) -> None:
    text = host.check_output("python3 -c 'import urllib.request; "
                             "print(urllib.request.urlopen(\"http://127.0.0.1:9835/metrics\").read().decode())'")
    assert "gb10_nvidia_smi_up 1.0" in text and "gb10_meminfo_up 1.0" in text
    assert "gb10_nvidia_smi_error" not in text
    assert "gb10_nvml_memory" not in text  # [N/A] on GB10: left out
    # nvidia-smi's timeout derived from the scrape timeout (3s here): 60 %, below it
    cmd = host.check_output("systemctl show -p ExecStart --value sparkllm-gb10-exporter.service")
    assert "--smi-timeout 1.8 " in cmd and "--ops-state-dir /var/lib/sparkllm-ops" in cmd
    total = int(host.check_output("awk '/^MemTotal:/ {print $2}' /proc/meminfo")) * 1024
    assert f"gb10_memory_total_bytes {float(total)!r}" in text
    assert host.service("sparkllm-gb10-exporter.service").is_running


def test_retention_and_fact(host) -> None:
    fact = json.loads(host.file("/etc/ansible/facts.d/spark_monitoring.fact").content_string)
    assert fact["runtime"] == "packages" and fact["scrape_targets"]["vllm"] == "127.0.0.1:8031"
    assert 1 <= int(fact["retention_size_gb"]) <= 20
    series = _api(host, "/api/v1/query?query=prometheus_tsdb_head_series")["data"]["result"][0]["value"][1]
    by_job = _api(host, "/api/v1/query?query=scrape_samples_scraped")["data"]["result"]
    jobs = {r["metric"]["job"]: int(r["value"][1]) for r in by_job}
    print(f"\nRETENTION FIGURE: head series {series}; samples per scrape by job {jobs}; "
          f"size cap {fact['retention_size_gb']} GB")
    assert int(series) > 100


@pytest.mark.parametrize(("extra", "message"), [
    ({"spark_monitoring_bind_address": "0.0.0.0"},
     "would expose Grafana beyond this machine without credentials"),
    ({"spark_monitoring_bind_address": "grafana.lan"}, "is not an IP address"),
    ({"spark_monitoring_runtime": "container",
      "spark_monitoring_images": {"prometheus": "prom/prometheus:v3.5.0",
                                  "node_exporter": "x@sha256:" + "0" * 64,
                                  "grafana": "g@sha256:" + "1" * 64}},
     "prometheus not pinned by digest"),
])
def test_bad_input_is_refused_before_anything_changes(host, extra: dict, message: str) -> None:
    before = host.file(f"{CONF}/prometheus/prometheus.yml").content_string
    res = run_playbook("playbooks/monitoring.yml", extra, timeout=300)
    assert res.rc != 0 and message in res.output, res.output[-3000:]
    assert host.file(f"{CONF}/prometheus/prometheus.yml").content_string == before


ALERTS = {"SparkServerDown", "SparkServerRestarted", "SparkMemoryGuardKill", "SparkWatchdogGaveUp",
          "SparkMemoryPressure", "SparkGpuThrottled", "SparkExporterSourceDown"}
OPS = "/var/lib/sparkllm-ops"


def _firing(host) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for a in _api(host, "/api/v1/alerts")["data"]["alerts"]:
        if a["state"] == "firing":
            out.setdefault(a["labels"]["alertname"], []).append(a["labels"])
    return out


def _wait_for(host, cond, what: str, timeout: float = 180) -> dict[str, list[dict]]:
    end = time.monotonic() + timeout
    while True:
        firing = _firing(host)
        if cond(firing):
            return firing
        assert time.monotonic() < end, f"{what}: after {timeout:.0f} s the alerts firing are {firing}"
        time.sleep(2)


def test_prometheus_loaded_every_alert_rule(host) -> None:
    res = host.run(f"promtool check rules {CONF}/prometheus/sparkllm-alerts.yml")
    assert res.rc == 0 and "SUCCESS: 7 rules found" in res.stdout, res.stdout + res.stderr
    groups = _api(host, "/api/v1/rules?type=alert")["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules) == ALERTS, set(rules) ^ ALERTS
    assert all(r["health"] == "ok" for r in rules.values()), {n: r["lastError"] for n, r in rules.items()}
    # a healthy stack fires nothing (the restart alert may still see prepare's start: wait it out)
    _wait_for(host, lambda f: not (set(f) - {"SparkServerRestarted"}), "quiet at the start")


def test_memory_pressure_rule_under_promtool(host) -> None:
    """MemAvailable comes from the real /proc/meminfo, so this rule is exercised by promtool's evaluator."""
    test = f"""rule_files: [{CONF}/prometheus/sparkllm-alerts.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'gb10_memory_available_bytes{{job="gb10",instance="127.0.0.1:9835"}}'
        values: '50 50 5 5 5 5'
      - series: 'gb10_memory_total_bytes{{job="gb10",instance="127.0.0.1:9835"}}'
        values: '100 100 100 100 100 100'
    alert_rule_test:
      - eval_time: 1m
        alertname: SparkMemoryPressure
        exp_alerts: []
      - eval_time: 4m
        alertname: SparkMemoryPressure
        exp_alerts:
          - exp_labels: {{severity: warning, job: gb10, instance: "127.0.0.1:9835"}}
            exp_annotations:
              summary: "Unified memory available is 5% of the total"
              description: "The memory guard acts at 6 %; close other work or lower gpu_memory_utilization."
"""
    host.check_output(f"mkdir -p /opt/alertcheck && cat > /opt/alertcheck/test.yml <<'EOF'\n{test}EOF")
    res = host.run("promtool test rules /opt/alertcheck/test.yml")
    assert res.rc == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_guard_kill_and_watchdog_give_up_fire(host) -> None:
    """The file contract of scripts/gb10_exporter.py: what spark_ops' tools write reaches Prometheus."""
    now = time.time()
    state = json.dumps({"restarts": [round(now - 30)], "gave_up": round(now), "failures": 0})
    kill = f"{now:.0f} 4242 VLLM::EngineCor"
    host.check_output(f"install -d -m 0755 {OPS} && cd {OPS} && echo '{kill}' > guard-kills.log")
    host.check_output(f"cd {OPS} && echo '{state}' > watchdog.json && chmod 0644 *")
    try:
        want = {"SparkMemoryGuardKill", "SparkWatchdogGaveUp", "SparkServerRestarted"}
        _wait_for(host, lambda f: want <= set(f), "guard kill / watchdog give-up")
    finally:
        host.check_output(f"rm -f {OPS}/guard-kills.log {OPS}/watchdog.json")
    _wait_for(host, lambda f: not {"SparkMemoryGuardKill", "SparkWatchdogGaveUp"} & set(f), "resolved")


def test_throttle_and_a_failing_nvidia_smi_fire_but_gpu_idle_does_not(host) -> None:
    line = "/etc/fake-nvidia-smi.line"
    try:
        host.check_output(f"echo '30.25, 45, 2405, 3003, 0, [N/A], [N/A], 0x0000000000000001' > {line}")
        time.sleep(16)  # well past the rules' for: 6s at a 2 s evaluation
        assert "SparkGpuThrottled" not in _firing(host)  # gpu_idle is not throttling
        host.check_output(f"echo '30.25, 45, 1800, 3003, 99, [N/A], [N/A], 0x0000000000000005' > {line}")
        firing = _wait_for(host, lambda f: "SparkGpuThrottled" in f, "sw_power_cap")
        assert [a["reason"] for a in firing["SparkGpuThrottled"]] == ["sw_power_cap"]
        host.check_output(f"echo '[N/A], [N/A], [N/A], [N/A], [N/A], [N/A], [N/A], [N/A]' > {line}")
        _wait_for(host, lambda f: "SparkExporterSourceDown" in f, "all-[N/A] nvidia-smi")
        text = host.check_output("python3 -c 'import urllib.request; "
                                 "print(urllib.request.urlopen(\"http://127.0.0.1:9835/metrics\").read().decode())'")
        assert "gb10_nvidia_smi_up 0.0" in text and 'gb10_nvidia_smi_error{reason="all_na"} 1.0' in text
    finally:
        host.check_output(f"rm -f {line}")
    _wait_for(host, lambda f: not {"SparkGpuThrottled", "SparkExporterSourceDown"} & set(f), "resolved")


def test_server_down_then_restarted_fire(host) -> None:
    host.check_output("systemctl stop standin.service")
    try:
        firing = _wait_for(host, lambda f: "SparkServerDown" in f, "server stopped")
        assert firing["SparkServerDown"][0]["method"] == "mtp"
    finally:
        host.check_output("systemctl start standin.service")
    _wait_for(host, lambda f: "SparkServerRestarted" in f and "SparkServerDown" not in f, "server back")


def test_images_present_are_not_pulled_again_offline(host) -> None:
    """The container runtime's image step against a stand-in registry: the first run pulls; a rerun asks
    the registry nothing; with the registry gone the rerun still succeeds while pull=always fails."""
    with RegistryStub("sparkllm-test/prometheus", "v3.5.0") as reg:
        images = {"prometheus": reg.ref, "node_exporter": reg.ref, "grafana": reg.ref}
        play = "molecule/metrics/pull_images.yml"
        try:
            first = run_playbook(play, {"spark_monitoring_images": images}, timeout=300)
            assert first.rc == 0 and reg.requests, first.output[-3000:]
            assert any("/manifests/" in r for r in reg.requests), reg.requests
            reg.requests.clear()
            again = run_playbook(play, {"spark_monitoring_images": images}, timeout=300)
            assert again.rc == 0 and "changed=0" in again.output, again.output[-3000:]
            assert reg.requests == [], reg.requests  # not even a manifest HEAD
            reg.stop()  # the registry is unreachable from now on
            offline = run_playbook(play, {"spark_monitoring_images": images}, timeout=300)
            assert offline.rc == 0 and "changed=0" in offline.output, offline.output[-3000:]
            control = run_playbook(play, {"spark_monitoring_images": images, "control_pull_always": True},
                                   timeout=300)
            assert control.rc != 0 and "connection refused" in control.output.lower(), control.output[-3000:]
        finally:
            subprocess.run(["docker", "rmi", f"{reg.repo}@{reg.digest}"], capture_output=True, check=False)
