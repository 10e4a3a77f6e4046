"""spark_monitoring's files: the Prometheus template, Grafana's provisioning and dashboards (checked by
Grafana's own schema models), the dashboard queries' metric names against the stand-in server's
/metrics, and the query runner's refusals."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import jinja2
import pytest
import yaml

from tests.fixtures.standin_server import server
from tests.harness import dashboard_queries, grafana_check

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "templates" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
ROLE = ROOT / "roles" / "spark_monitoring"
# the role's defaults over the project-wide facts it reads (group_vars/all/shared.yml: ports, unit prefix)
DEFAULTS = {**yaml.safe_load((ROOT / "group_vars" / "all" / "shared.yml").read_text()),
            **yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())}
VARS = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())


def render(path: Path, **ctx: object) -> str:
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    values = {k: v for k, v in DEFAULTS.items() if not (isinstance(v, str) and "{{" in v)}
    values.update(spark_monitoring_grafana_dashboards_path=VARS["spark_monitoring_grafana_dashboards_path"])
    values.update(ctx)
    return env.from_string(path.read_text()).render(ansible_managed="Ansible managed", **values)


def provisioning(tmp: Path) -> Path:
    root = tmp / "grafana"
    for src, dest in (("datasource.yml.j2", "provisioning/datasources/sparkllm.yml"),
                      ("dashboards.yml.j2", "provisioning/dashboards/sparkllm.yml")):
        (root / dest).parent.mkdir(parents=True, exist_ok=True)
        (root / dest).write_text(render(GRAFANA / src))
    (root / "dashboards").mkdir()
    for d in DASHBOARDS:
        (root / "dashboards" / d.name).write_text(d.read_text())
    return root


def exprs() -> list[str]:
    return [t["expr"] for d in DASHBOARDS for p in json.loads(d.read_text())["panels"] for t in p["targets"]]


def test_prometheus_config_scrapes_the_three_sources_on_loopback() -> None:
    text = render(ROOT / "templates" / "prometheus.yml.j2", spec_method="mtp",
                  _spark_monitoring_vllm_target="127.0.0.1:8000", _spark_monitoring_vllm_scheme="http",
                  _spark_monitoring_rules_file="/etc/prometheus/sparkllm-alerts.yml",
                  inventory_hostname="spark-a", _spark_monitoring_worker_targets=[])
    cfg = yaml.safe_load(text)
    assert cfg["rule_files"] == ["/etc/prometheus/sparkllm-alerts.yml"]
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
    assert jobs == {"vllm": ["127.0.0.1:8000"], "node": ["127.0.0.1:9100"], "gb10": ["127.0.0.1:9835"],
                    "prometheus": ["127.0.0.1:9090"]}
    assert cfg["global"]["scrape_interval"] == "15s"
    assert cfg["scrape_configs"][0]["static_configs"][0]["labels"] == {"method": "mtp"}


def test_the_heads_prometheus_scrapes_every_workers_exporters_over_the_link() -> None:
    """Several Sparks: a worker runs node exporter and the GB10 exporter on its link address; the head's
    Prometheus scrapes them there, each series labelled with the node it came from."""
    text = render(ROOT / "templates" / "prometheus.yml.j2", spec_method="mtp",
                  _spark_monitoring_vllm_target="127.0.0.1:8000", _spark_monitoring_vllm_scheme="http",
                  _spark_monitoring_rules_file="/etc/prometheus/sparkllm-alerts.yml",
                  inventory_hostname="spark-a",
                  _spark_monitoring_worker_targets=[{"node": "spark-b", "node_target": "192.168.100.11:9100",
                                                     "gb10_target": "192.168.100.11:9835"}])
    jobs = {j["job_name"]: j["static_configs"] for j in yaml.safe_load(text)["scrape_configs"]}
    assert jobs["node"] == [{"targets": ["127.0.0.1:9100"], "labels": {"node": "spark-a"}},
                            {"targets": ["192.168.100.11:9100"], "labels": {"node": "spark-b"}}]
    assert jobs["gb10"][1] == {"targets": ["192.168.100.11:9835"], "labels": {"node": "spark-b"}}
    assert len(jobs["vllm"]) == 1  # the server is the head's only


def test_grafana_files_pass_grafanas_schema(tmp_path: Path) -> None:
    assert DASHBOARDS
    assert grafana_check.check_dir(provisioning(tmp_path)) == []


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["panels"][0].__setitem__("gridpos", d["panels"][0].pop("gridPos")), "not a field of"),
    (lambda d: d["panels"][1]["targets"][0].__setitem__("exp", "up"), "/targets[0]/exp: not a field"),
    (lambda d: d["panels"][2]["targets"][0].__setitem__("datasource", {"type": "prometheus", "uid": "other"}),
     "datasource uid 'other' is not provisioned"),
    (lambda d: d["templating"].__setitem__("list", []), "datasource uid '${datasource}' is not provisioned"),
    (lambda d: d["panels"][3].__setitem__("id", 1), "panel ids are not unique"),
    (lambda d: d["panels"][0]["gridPos"].__setitem__("x", 20), "exceeds Grafana's 24 columns"),
])
def test_schema_check_catches_a_broken_dashboard(mutate, message: str) -> None:
    d = copy.deepcopy(json.loads(DASHBOARDS[0].read_text()))
    mutate(d)
    problems = grafana_check.check_dashboard(d, {"sparkllm-prometheus"})
    assert any(message in p for p in problems), problems


def test_schema_check_catches_broken_provisioning() -> None:
    assert "datasource lacks 'url'" in " ".join(grafana_check.check_datasources(
        {"apiVersion": 1, "datasources": [{"name": "p", "type": "prometheus", "access": "proxy"}]}, "ds"))
    assert "provider option 'pathh'" in " ".join(grafana_check.check_providers(
        {"apiVersion": 1, "providers": [{"name": "x", "type": "file", "options": {"pathh": "/d"}}]}, "pr"))


def test_dashboard_covers_what_the_issue_asks() -> None:
    text = " ".join(exprs())
    for needed in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket",
                   "vllm:request_time_per_output_token_seconds_bucket",
                   "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:spec_decode_num_drafts_total",
                   "gb10_power_draw_watts", "gb10_memory_available_bytes", "node_"):
        assert needed in text, needed
    # J/token: power over decode rate in one expression
    assert any("gb10_power_draw_watts" in e and "generation_tokens_total" in e for e in exprs())


def test_every_hardware_panel_shows_each_selected_spark() -> None:
    """Two Sparks: a sum or max over both hides a worker running hot or out of memory. Each hardware query
    (GB10 and node exporter) keeps the node label and follows the dashboard's node selector, except the
    energy per token, which needs every Spark's power."""
    hardware = [e for e in exprs() if re.search(r"\b(gb10_|node_)", e)]
    energy = [e for e in hardware if "generation_tokens_total" in e]
    assert len(energy) == 1 and "$node" not in energy[0]
    for e in hardware:
        if e not in energy:
            assert 'node=~"$node"' in e and "by (node)" in e, e


def test_the_standin_exposes_every_vllm_metric_the_dashboards_query() -> None:
    cfg, _, _ = server.parse_args(["--method", "mtp", "--k", "2", "--model", "m", "--step-time", "0.001"])
    with server.StandinServer(cfg) as srv:
        body = json.dumps({"model": "m", "stream": True, "max_tokens": 12,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(srv.base_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        truth = srv.truth[0]
    exposed = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", metrics, re.M))
    wanted = {n for e in exprs() for n in re.findall(r"\b(vllm:[a-z_]+)", e)}
    assert wanted and wanted <= exposed, wanted - exposed
    # the per-request TPOT histogram as vLLM observes it: decode time / (tokens - 1)
    tpot = re.search(r"^vllm:request_time_per_output_token_seconds_sum\S* (\S+)$", metrics, re.M)
    tpot_sum = float(tpot[1])
    assert tpot_sum == pytest.approx((truth.last_token_time - truth.first_token_time) / (truth.tokens - 1))


def test_query_runner_substitutes_only_what_it_knows() -> None:
    assert dashboard_queries.substitute("rate(x[$__rate_interval])", "20s") == "rate(x[20s])"
    with pytest.raises(ValueError, match=r"uses \$job"):
        dashboard_queries.substitute('up{job="$job"}', "20s")
    # a multi-value variable: what Grafana sends for its default "All" selection
    assert dashboard_queries.substitute('x{node=~"$node"} + y{node=~"${node}"} + $nodes', "20s",
                                        {"node": ".+", "nodes": "1"}) == 'x{node=~".+"} + y{node=~".+"} + 1'
    dash = json.loads((ROOT / "templates/grafana/dashboards/spark-serving.json").read_text())
    assert dashboard_queries.all_values(dash) == {"node": ".+"}
    rows = [{"dashboard": "d", "panel_id": 1, "title": "t", "ref_id": "A", "query": "q",
             "instant_status": "success", "range_status": "success",
             "instant": [{"metric": {}, "value": [0, "NaN"]}], "range": []}]
    assert "no finite data now" in dashboard_queries.problems(rows)[0]


def _monitoring_play(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    inv = tmp / "inv.yml"
    inv.write_text(yaml.safe_dump({"spark": {"hosts": {"sparkx": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    play = str(ROOT / "playbooks" / "monitoring.yml")
    env.pop("ANSIBLE_INVENTORY", None)
    return subprocess.run(["ansible-playbook", "-i", str(inv), play, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_disabled_by_default_runs_nothing_on_the_host(tmp_path: Path) -> None:
    r = _monitoring_play(tmp_path)
    assert r.returncode == 0, r.stdout[-2000:]
    # only the argument-spec validation (answered by the controller) is ok; no task changed anything
    assert re.search(r"sparkx\s*: ok=1\s+changed=0", r.stdout), r.stdout[-1500:]


def test_enabled_with_an_open_bind_and_no_credentials_is_refused(tmp_path: Path) -> None:
    r = _monitoring_play(tmp_path, "-e", json.dumps({"spark_monitoring_enabled": True,
                                                     "spark_monitoring_bind_address": "192.168.1.20"}))
    assert r.returncode == 2
    assert "spark_monitoring_bind_address=192.168.1.20 would expose Grafana beyond this machine" in r.stdout
    assert "changed=0" in r.stdout


def test_dashboards_take_the_datasource_from_a_variable_not_a_uid() -> None:
    """A Grafana whose Prometheus source has another UID (added by hand, or a customised provisioning)
    still shows the panels: every query names ${datasource}, a variable over Prometheus sources."""
    for d in DASHBOARDS:
        data = json.loads(d.read_text())
        var = [v for v in data["templating"]["list"] if v["name"] == "datasource"]
        assert var and var[0]["type"] == "datasource" and var[0]["query"] == "prometheus"
        assert "current" not in var[0]  # no UID there either: Grafana selects the default source
        uids = {(t.get("datasource") or p.get("datasource"))["uid"]
                for p in data["panels"] for t in p["targets"]}
        uids |= {p["datasource"]["uid"] for p in data["panels"]}
        assert uids == {"${datasource}"}, uids
        assert DEFAULTS["spark_monitoring_grafana_datasource_uid"] not in d.read_text()


def test_throttle_panel_leaves_the_idle_bit_out() -> None:
    throttle = [e for e in exprs() if "gb10_clocks_throttle_reason_active" in e]
    assert throttle and all('reason!="gpu_idle"' in e for e in throttle), throttle


ALERTS = ROOT / "templates" / "prometheus-alerts.yml.j2"


def _alert_rules(**ctx: object) -> dict[str, dict]:
    text = render(ALERTS, spec_method="mtp", **ctx)
    groups = yaml.safe_load(text)["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_alert_rules_cover_the_issue_and_match_the_roles_check() -> None:
    rules = _alert_rules()
    assert list(rules) == VARS["_spark_monitoring_alert_names"]
    assert rules["SparkServerDown"]["expr"] == 'up{job="vllm"} == 0'
    assert rules["SparkServerDown"]["for"] == DEFAULTS["spark_monitoring_alert_for"]
    assert "process_start_time_seconds" in rules["SparkServerRestarted"]["expr"]
    assert "sparkllm_watchdog_gave_up == 1" in rules["SparkWatchdogGaveUp"]["expr"]
    assert "sparkllm_guard_last_kill_timestamp_seconds" in rules["SparkMemoryGuardKill"]["expr"]
    assert "< 0.1" in rules["SparkMemoryPressure"]["expr"]
    throttled = rules["SparkGpuThrottled"]["expr"]
    assert "gpu_idle" not in throttled and "sw_power_cap" in throttled and "hw_thermal_slowdown" in throttled
    # every expression's metric is one an exporter of ours (or vLLM/Prometheus) exports
    for r in rules.values():
        for name in re.findall(r"\b(gb10_[a-z_]+|sparkllm_[a-z_]+)", r["expr"]):
            assert name in (ROOT / "scripts" / "gb10_exporter.py").read_text(), name
    # the knobs reach the rules
    rules = _alert_rules(spark_monitoring_alert_for="7s", spark_monitoring_alert_recent_s=60,
                         spark_monitoring_alert_memory_available_ratio=0.25)
    assert rules["SparkServerDown"]["for"] == "7s" and "[60s]" in rules["SparkServerRestarted"]["expr"]
    assert "< 0.25" in rules["SparkMemoryPressure"]["expr"]
