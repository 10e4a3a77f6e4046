"""The monitoring stack on the test host: real Prometheus (Debian's package) with our configuration
scrapes the stand-in server, node exporter and the GB10 exporter; every panel query of the dashboards
in templates/grafana/dashboards/ returns data; everything listens on loopback; bad input is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from playbook_runner import PROJECT, run_playbook

sys.path.insert(0, str(PROJECT / "tests" / "harness"))
import grafana_check  # noqa: E402

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
    assert "gb10_nvidia_smi_up 1.0" in text
    assert "gb10_nvml_memory" not in text  # [N/A] on GB10: left out
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
