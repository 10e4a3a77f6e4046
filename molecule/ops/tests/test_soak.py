"""A soak on the systemd test host (issue 45 item 5): the stand-in server under mixed load for SOAK_S seconds
(files/soak.py: a long prefill, short streams one after another, a client that hangs up mid-stream, a burst of
2 x max_num_seqs + 1) with the memory guard, the watchdog and the GB10 exporter running. Asserted: no restart,
no request lost but the cancelled one, memory flat by the exporter's own figure, every figure the dashboard's
panels read finite. One SOAK FIGURE line.

File order puts this after test_ops.py (which ends with the server stopped and the watchdog given up) and
before test_watchdog.py; it depends on neither: it starts what it needs, as test_watchdog.py's first test
does, waits for the server healthy and idle, and takes the restart counters at its own start.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import time

from host_probe import healthy, host_now, invocation, journal, wait_until
from playbook_runner import PROJECT

sys.path.insert(0, str(PROJECT / "tests" / "harness"))
sys.path.insert(0, str(PROJECT / "scripts"))
import dashboard_queries  # noqa: E402
from sparkllm.bench.prometheus import MetricsSnapshot, delta, restart_problem  # noqa: E402

PORT = 18471
URL = f"http://127.0.0.1:{PORT}"
MODEL = "qwen3.5-122b"  # vllm_served_model_name (group_vars)
UNIT = "sparkllm-vllm-baseline.service"
KEY = "/etc/molecule-ops-api-key"  # host_vars: vllm_api_key_file
WEDGE = "/var/tmp/molecule-ops-wedge/on"
ENGINE_WEDGE = "/var/tmp/molecule-ops-wedge/engine"
PAUSE = "/run/sparkllm-ops/watchdog.pause"  # serve_watchdog_pause_file
MAX_NUM_SEQS = 4  # group_vars: vllm_max_num_seqs, passed as --max-num-seqs
EXPORTER = "ops-gb10-exporter.service"  # prepare.yml
EXPORTER_URL = "http://127.0.0.1:18479"  # its --port in prepare.yml
OUT = "/tmp/ops-soak.json"
# New requests start for SOAK_S s; with the start, the settling and the in-flight tail the test takes
# ~2.5 minutes (CI's 45-minute limit is near; the stall, grace and probe timers are scaled down as much).
SOAK_S = 120
# "Flat": the test host's MemAvailable as the exporter reports it (gb10_memory_available_bytes, the cgroup's
# figure) may fall by at most 64 MiB between the idle start and the idle end (3 % of the 2 GiB, an eighth of
# the 512 MiB the server reserves); the server's resident set may grow by at most 32 MiB. Each is the median
# of three readings a second apart (a watchdog run, a short-lived python3 of ~15 MiB, may fall on one).
MEM_AVAIL_DROP_MAX = 64 * 2**20
SERVER_RSS_GROWTH_MAX = 32 * 2**20
DASHBOARDS = sorted((PROJECT / "templates" / "grafana" / "dashboards").glob("*.json"))
# Series a panel reads that this scenario cannot have: node exporter is not deployed here
# (roles/spark_monitoring, off); no nvidia-smi on the test host (the exporter says gb10_nvidia_smi_up 0); the
# baseline method registers no spec-decode counters (vllm/v1/spec_decode/metrics.py:150-152 of 0.19.1: none
# without a speculative config).
ABSENT_HERE = re.compile(r"^(node_|vllm:spec_decode_|gb10_(power|temperature|sm_clock|clocks_throttle))")


def _scrape(host, url: str) -> MetricsSnapshot:
    return MetricsSnapshot.parse(host.check_output(f"curl -sf --max-time 5 {url}/metrics"))


def _gauges(host) -> tuple[int, int]:
    snap = _scrape(host, URL)
    return int(snap.total("vllm:num_requests_running")), int(snap.total("vllm:num_requests_waiting"))


def _nrestarts(host) -> str:
    return host.check_output(f"systemctl show -p NRestarts --value {UNIT}")


def _memory(host) -> tuple[float, int]:
    """(MemAvailable by the exporter, the server's VmRSS) in bytes, each the median of three readings."""
    avail, rss = [], []
    for _ in range(3):
        avail.append(_scrape(host, EXPORTER_URL).total("gb10_memory_available_bytes"))
        rss.append(1024 * int(host.check_output("awk '/VmRSS/ {print $2}' /proc/$(pgrep -x vllm)/status")))
        time.sleep(1)
    return statistics.median(avail), int(statistics.median(rss))


def _panel_series() -> set[str]:
    """The series names the dashboards' panel queries read (dashboard_queries reads the queries)."""
    names = set()
    for path in DASHBOARDS:
        for q in dashboard_queries.panel_queries(json.loads(path.read_text())):
            expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", q["expr"])  # grouping labels are no series
            expr = re.sub(r"\{[^}]*\}", "{}", expr)  # nor are label matchers
            names |= set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)(?=\s*[{\[)]|\s*$)", expr))
    return {n for n in names if ":" in n or "_" in n}


def _unreadable(series: set[str], server: MetricsSnapshot, exporter: MetricsSnapshot) -> list[str]:
    """What the panels read that is missing or not finite (the series this scenario cannot have aside)."""
    bad = []
    for name in sorted(series):
        snap = exporter if name.startswith(("gb10_", "sparkllm_")) else server
        values = [v for (n, _), v in snap.samples.items() if n == name]
        if not values and not ABSENT_HERE.match(name):
            bad.append(f"{name}: absent")
        bad += [f"{name}: {v}" for v in values if not math.isfinite(v)]
    return bad


def test_a_soak_under_mixed_load_keeps_the_server_up_whole_and_flat(host):
    # test_ops.py leaves the server stopped and the watchdog given up: start them, the exporter too
    host.run(f"rm -f {WEDGE} {ENGINE_WEDGE} {PAUSE} {OUT}")
    host.run(f"systemctl reset-failed sparkllm-watchdog.service {UNIT}")  # and clear the unit's start limit
    host.check_output(f"systemctl start {UNIT} sparkllm-watchdog.timer {EXPORTER}")
    try:
        wait_until(lambda: healthy(host, PORT), 60, "the server's /health")
        wait_until(lambda: host.run(f"curl -sf --max-time 2 {EXPORTER_URL}/metrics").rc == 0, 30,
                   "the exporter")
        wait_until(lambda: _gauges(host) == (0, 0), 60, "no request in flight")
        series = _panel_series()
        assert {"vllm:generation_tokens_total", "gb10_memory_available_bytes"} <= series, series
        t0, inv0, nrestarts0 = host_now(host), invocation(host, UNIT), _nrestarts(host)
        avail0, rss0 = _memory(host)
        m0 = _scrape(host, URL)
        host.check_output(f"systemd-run --unit ops-soak --collect /usr/local/bin/ops-soak {URL} {MODEL} "
                          f"{KEY} --out {OUT} --duration {SOAK_S} --max-num-seqs {MAX_NUM_SEQS}")
        try:
            peak_running, peak_waiting, avail_min, problems = 0, 0, avail0, []
            end = time.monotonic() + SOAK_S + 180  # the in-flight tail: a queued burst, the long prefill
            while host.run("systemctl is-active --quiet ops-soak.service").rc == 0:
                assert time.monotonic() < end, "the soak's load did not end"
                server, exporter = _scrape(host, URL), _scrape(host, EXPORTER_URL)
                peak_running = max(peak_running, int(server.total("vllm:num_requests_running")))
                peak_waiting = max(peak_waiting, int(server.total("vllm:num_requests_waiting")))
                avail_min = min(avail_min, exporter.total("gb10_memory_available_bytes"))
                problems += _unreadable(series, server, exporter)
                time.sleep(3)
        finally:
            host.run("systemctl stop ops-soak.service")
        assert host.file(OUT).exists, journal(host, t0, "-u", "ops-soak.service")
        res = json.loads(host.file(OUT).content_string)
        # the cancelled stream gave its slot back; nothing is left running or waiting
        wait_until(lambda: _gauges(host) == (0, 0), 30, "every request to leave the server")
        time.sleep(3)  # the freed memory settles
        avail1, rss1 = _memory(host)
        m1, exporter1 = _scrape(host, URL), _scrape(host, EXPORTER_URL)
        log = journal(host, t0, "-t", "sparkllm-watchdog")

        # no restart: the same invocation, systemd restarted nothing, the watchdog judged no failure
        assert invocation(host, UNIT) == inv0 and _nrestarts(host) == nrestarts0
        assert restart_problem(m0, m1) is None, restart_problem(m0, m1)
        assert "restarting" not in log and "probe failed" not in log and "GAVE UP" not in log, log
        # no request lost but the one cancelled; the burst went above max_num_seqs and waited, as vLLM queues
        assert res["lost"] == 0, res["lost_detail"]
        assert res["cancelled"] == 1 and res["requests"] == res["completed"] + 1, res
        assert res["kinds"]["burst"] == {"completed": 2 * MAX_NUM_SEQS + 1}, res["kinds"]
        assert res["kinds"]["long"] == {"completed": 1}, res["kinds"]
        assert res["kinds"]["short"]["completed"] > 50, res["kinds"]
        assert peak_running <= MAX_NUM_SEQS and peak_waiting > 0, (peak_running, peak_waiting)
        # the server counted them (the watchdog's one-token probes on top)
        assert delta(m0, m1, "vllm:request_success_total") >= res["completed"]
        assert delta(m0, m1, "vllm:generation_tokens_total") >= res["tokens"]
        # memory flat (module doc for the tolerances)
        assert avail1 >= avail0 - MEM_AVAIL_DROP_MAX, (avail0, avail1)
        assert rss1 <= rss0 + SERVER_RSS_GROWTH_MAX, (rss0, rss1)
        # every figure the panels read is there and finite, during the load and after it; the latency panels'
        # histograms observed the soak (their quantiles over its window have data)
        problems += _unreadable(series, m1, exporter1)
        assert not problems, sorted(set(problems))
        for name in sorted(n for n in series if n.endswith("_bucket")):
            count = name.removesuffix("_bucket") + "_count"
            assert delta(m0, m1, count) > 0, f"{count} did not move during the soak"
        mib = 2**20
        here = {n for (n, _) in [*m1.samples, *exporter1.samples]} & series
        print(f"\nSOAK FIGURE: {res['requests']} requests ({res['completed']} completed, {res['cancelled']} "
              f"cancelled, {res['lost']} lost; burst {2 * MAX_NUM_SEQS + 1} > max_num_seqs {MAX_NUM_SEQS}, "
              f"peak {peak_running} running + {peak_waiting} waiting), {res['tokens']} tokens in "
              f"{res['duration_s']} s, long prefill {res['long_prefill_s']} s; restarts 0 "
              f"(NRestarts {nrestarts0}, InvocationID unchanged); MemAvailable {avail0 / mib:.0f} -> "
              f"{avail1 / mib:.0f} MiB (min {avail_min / mib:.0f}), server RSS {rss0 / mib:.0f} -> "
              f"{rss1 / mib:.0f} MiB; panel series finite: {len(here)} of {len(series)} (the others not in "
              "this scenario: node exporter, nvidia-smi, spec decode)")
    finally:
        host.run(f"systemctl stop {EXPORTER}")
