"""scripts/gb10_exporter.py and sparkllm.gpu_smi: GB10-shaped nvidia-smi output ([N/A] memory), a
missing or failing nvidia-smi, the scrape over HTTP."""

from __future__ import annotations

import re
import sys
import threading
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path

import gb10_exporter as exp
import pytest
from sparkllm import gpu_smi

# What a GB10 prints for the exporter's fields (memory.used and memory.total are [N/A] there)
GB10_LINE = "11.42, 44, 2405, 3003, 96, [N/A], [N/A], 0x0000000000000004"
MEMINFO = """MemTotal:       128452844 kB
MemFree:         1049112 kB
MemAvailable:   119876543 kB
SwapTotal:       16777212 kB
SwapFree:        16777212 kB
HugePages_Total:       0
"""


def fake_smi(tmp: Path, body: str) -> str:
    exe = tmp / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    return str(exe)


def gb10_smi(tmp: Path) -> str:
    """Answers only the exporter's exact query, as CSV without units; anything else is an error."""
    want = "--query-gpu=" + ",".join(exp.FIELDS)
    return fake_smi(tmp, f'[ "$1" = "{want}" ] && [ "$2" = "--format=csv,noheader,nounits" ] '
                         f'|| {{ echo "unexpected args: $*" >&2; exit 9; }}\necho "{GB10_LINE}"\n')


def parse(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}; every sample line must be well formed."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)', line)
        assert m, f"malformed sample line {line!r}"
        out[m.group(1)] = float(m.group(2))
    return out


@pytest.fixture()
def meminfo(tmp_path: Path) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(MEMINFO)
    return p


def test_gb10_output_with_na_memory(tmp_path: Path, meminfo: Path) -> None:
    m = parse(exp.Collector(gb10_smi(tmp_path), meminfo).collect())
    assert m["gb10_nvidia_smi_up"] == 1.0
    assert m['gb10_power_draw_watts{gpu="0"}'] == 11.42
    assert m['gb10_temperature_celsius{gpu="0"}'] == 44.0
    assert m['gb10_sm_clock_hertz{gpu="0"}'] == 2405e6
    assert m['gb10_sm_clock_max_hertz{gpu="0"}'] == 3003e6
    assert m['gb10_utilization_ratio{gpu="0"}'] == pytest.approx(0.96)
    # [N/A] is left out, never exported as 0
    assert not any(k.startswith("gb10_nvml_memory") for k in m)
    # the memory comes from /proc/meminfo (kB = KiB)
    assert m["gb10_memory_total_bytes"] == 128452844 * 1024
    assert m["gb10_memory_available_bytes"] == 119876543 * 1024
    assert m["gb10_swap_free_bytes"] == 16777212 * 1024
    # 0x4 = SW power cap, and only that
    assert m['gb10_clocks_throttle_reasons_bitmask{gpu="0"}'] == 4.0
    assert m['gb10_clocks_throttle_reason_active{gpu="0",reason="sw_power_cap"}'] == 1.0
    active = [k for k, v in m.items() if k.startswith("gb10_clocks_throttle_reason_active") and v]
    assert len(active) == 1


# What a real nvidia-smi printed for the exporter's exact query (NVIDIA H200, driver 580.159.04, idle,
# 2026-12-02, on the GPU host: `nvidia-smi --query-gpu=<exp.FIELDS> --format=csv,noheader,nounits`). Not a
# GB10, but the same driver branch and field names: every field answered, the throttle bitmask in hex.
H200_FIELDS = ("power.draw,temperature.gpu,clocks.sm,clocks.max.sm,utilization.gpu,memory.used,memory.total,"
               "clocks_throttle_reasons.active")
H200_LINE = "77.78, 41, 345, 1980, 0, 0, 143771, 0x0000000000000001"


def test_a_real_nvidia_smi_answer_to_the_exporters_query(tmp_path: Path, meminfo: Path) -> None:
    assert ",".join(exp.FIELDS) == H200_FIELDS  # the query that was run for real is still the exporter's
    exe = fake_smi(tmp_path, f'[ "$1" = "--query-gpu={H200_FIELDS}" ] || exit 9\necho "{H200_LINE}"\n')
    m = parse(exp.Collector(exe, meminfo).collect())
    assert m['gb10_power_draw_watts{gpu="0"}'] == 77.78
    assert m['gb10_sm_clock_hertz{gpu="0"}'] == 345e6 and m['gb10_sm_clock_max_hertz{gpu="0"}'] == 1980e6
    assert m['gb10_nvml_memory_total_bytes{gpu="0"}'] == 143771 * 2**20  # MiB where NVML reports memory
    assert m['gb10_clocks_throttle_reasons_bitmask{gpu="0"}'] == 1.0
    active = [k for k, v in m.items() if k.startswith("gb10_clocks_throttle_reason_active") and v]
    assert active == ['gb10_clocks_throttle_reason_active{gpu="0",reason="gpu_idle"}']


def test_missing_nvidia_smi_still_answers_with_memory(meminfo: Path) -> None:
    text = exp.Collector(None, meminfo).collect()
    m = parse(text)
    assert m["gb10_nvidia_smi_up"] == 0.0
    assert m["gb10_memory_available_bytes"] == 119876543 * 1024
    assert not any(k.startswith(("gb10_power", "gb10_temperature", "gb10_sm_clock")) for k in m)
    assert "# nvidia-smi: not found on PATH" in text


def test_nvidia_smi_failing_or_printing_garbage(tmp_path: Path, meminfo: Path) -> None:
    exe = fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate" >&2; exit 9\n')
    text = exp.Collector(exe, meminfo).collect()
    assert parse(text)["gb10_nvidia_smi_up"] == 0.0
    assert "exited 9: NVIDIA-SMI has failed" in text
    exe = fake_smi(tmp_path, 'echo "1.0, 2.0"\n')  # two values for eight fields
    with pytest.raises(gpu_smi.SmiError, match="not 8 values"):
        gpu_smi.query(exe, exp.FIELDS)
    assert parse(exp.Collector(exe, meminfo).collect())["gb10_nvidia_smi_up"] == 0.0


def test_driver_without_the_throttle_field_falls_back(tmp_path: Path, meminfo: Path) -> None:
    exe = fake_smi(tmp_path, 'case "$1" in *clocks_throttle_reasons*) '
                             'echo \'Field "clocks_throttle_reasons.active" is not a valid field\'; '
                             'exit 2;; esac\necho "20.5, 50, 2000, 3003, 10, [N/A], [N/A]"\n')
    c = exp.Collector(exe, meminfo)
    m = parse(c.collect())
    assert m["gb10_nvidia_smi_up"] == 1.0 and m['gb10_power_draw_watts{gpu="0"}'] == 20.5
    assert exp.THROTTLE_FIELD not in c.fields
    assert not any(k.startswith("gb10_clocks_throttle") for k in m)


def test_meminfo_unreadable_and_na_parsing(tmp_path: Path) -> None:
    assert gpu_smi.meminfo(tmp_path / "absent") == {}
    assert gpu_smi.mem_available_mib(tmp_path / "absent") is None
    assert gpu_smi.num("[N/A]") is None and gpu_smi.num("[Not Supported]") is None
    assert gpu_smi.bitmask("[N/A]") is None and gpu_smi.bitmask("0x0000000000000044") == 0x44


def test_scrape_over_http(tmp_path: Path, meminfo: Path) -> None:
    exp.Handler.collector = exp.Collector(gb10_smi(tmp_path), meminfo)
    server = ThreadingHTTPServer(("127.0.0.1", 0), exp.Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            m = parse(r.read().decode())
        assert m['gb10_power_draw_watts{gpu="0"}'] == 11.42
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "/other", timeout=10)
    finally:
        server.shutdown()
        server.server_close()


def test_once_and_usage(tmp_path: Path, meminfo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert exp.main(["--once", "--nvidia-smi", gb10_smi(tmp_path), "--meminfo", str(meminfo)]) == 0
    assert "gb10_power_draw_watts" in capsys.readouterr().out
    # nothing readable at all: exit 1
    assert exp.main(["--once", "--nvidia-smi", str(tmp_path / "none"), "--meminfo", str(tmp_path / "x")]) == 1
    assert exp.main(["--port", "70000"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_exporter_is_stdlib_only() -> None:
    src = (Path(exp.__file__).read_text() + Path(gpu_smi.__file__).read_text())
    mods = set(re.findall(r"^(?:from|import) ([a-zA-Z_]+)", src, re.M))
    assert mods - {"__future__", "sparkllm"} <= set(sys.stdlib_module_names), mods


def test_all_na_answer_is_not_up(tmp_path: Path, meminfo: Path) -> None:
    """A driver that answers [N/A] for every field (e.g. the GPU fell off the bus) is a failed source."""
    exe = fake_smi(tmp_path, 'echo "' + ", ".join(["[N/A]"] * len(exp.FIELDS)) + '"\n')
    text = exp.Collector(exe, meminfo).collect()
    m = parse(text)
    assert m["gb10_nvidia_smi_up"] == 0.0
    assert m['gb10_nvidia_smi_error{reason="all_na"}'] == 1.0
    assert not any(k.startswith(("gb10_power", "gb10_clocks")) for k in m)
    assert m["gb10_meminfo_up"] == 1.0  # the other source still answers


@pytest.mark.parametrize(("body", "reason"), [
    ('echo "no GPU" >&2; exit 9\n', "failed"),
    ('echo "1.0, 2.0"\n', "unparsable"),
    ("sleep 5\n", "timeout"),
])
def test_each_nvidia_smi_failure_names_its_reason(tmp_path: Path, meminfo: Path, body: str,
                                                  reason: str) -> None:
    m = parse(exp.Collector(fake_smi(tmp_path, body), meminfo, smi_timeout=0.5).collect())
    assert m["gb10_nvidia_smi_up"] == 0.0
    errors = {k: v for k, v in m.items() if k.startswith("gb10_nvidia_smi_error")}
    assert errors == {f'gb10_nvidia_smi_error{{reason="{reason}"}}': 1.0}
    assert parse(exp.Collector(None, meminfo).collect())['gb10_nvidia_smi_error{reason="not_found"}'] == 1.0
    assert parse(exp.Collector(str(tmp_path / "absent"), meminfo).collect())[
        'gb10_nvidia_smi_error{reason="not_found"}'] == 1.0


def test_nan_and_inf_are_never_exported(tmp_path: Path, meminfo: Path) -> None:
    exe = fake_smi(tmp_path, 'echo "nan, inf, -inf, 2405, NaN, [N/A], [N/A], 0x0"\n')
    text = exp.Collector(exe, meminfo).collect()
    assert not re.search(r"(?i)\b(nan|inf)\b", " ".join(line for line in text.splitlines()
                                                         if not line.startswith("#")))
    m = parse(text)
    assert m['gb10_sm_clock_max_hertz{gpu="0"}'] == 2405e6 and m["gb10_nvidia_smi_up"] == 1.0
    for gone in ("gb10_power_draw_watts", "gb10_temperature_celsius", "gb10_sm_clock_hertz",
                 "gb10_utilization"):
        assert gone not in text


def test_unreadable_meminfo_is_reported(tmp_path: Path) -> None:
    m = parse(exp.Collector(gb10_smi(tmp_path), tmp_path / "absent").collect())
    assert m["gb10_meminfo_up"] == 0.0 and m["gb10_nvidia_smi_up"] == 1.0
    assert "gb10_memory_available_bytes" not in m


def test_ops_state_watchdog_and_guard(tmp_path: Path, meminfo: Path) -> None:
    """The file contract with spark_ops: watchdog.json (ops_watchdog.py's own state) and guard-kills.log."""
    ops = tmp_path / "ops"
    ops.mkdir()
    smi = gb10_smi(tmp_path)
    m = parse(exp.Collector(smi, meminfo, ops_state_dir=ops).collect())
    # nothing written yet: no watchdog state, no kill
    assert m['sparkllm_ops_state_up{file="watchdog.json"}'] == 0.0
    assert m['sparkllm_ops_state_up{file="guard-kills.log"}'] == 1.0
    assert m["sparkllm_guard_kills_total"] == 0.0 and "sparkllm_guard_last_kill_timestamp_seconds" not in m
    (ops / "watchdog.json").write_text('{"restarts": [1700000000.5, 1700000100.0], "failures": 2, '
                                       '"gave_up": 1700000200.0, "invocation": "x", "healthy_seen": false}')
    (ops / "guard-kills.log").write_text("1700000300 4242 VLLM::EngineCor\n1700000400 4343 vllm\ngarbage\n")
    m = parse(exp.Collector(smi, meminfo, ops_state_dir=ops).collect())
    assert m['sparkllm_ops_state_up{file="watchdog.json"}'] == 1.0
    assert m["sparkllm_watchdog_gave_up"] == 1.0
    assert m["sparkllm_watchdog_gave_up_timestamp_seconds"] == 1700000200.0
    assert m["sparkllm_watchdog_restarts_in_window"] == 2.0
    assert m["sparkllm_watchdog_last_restart_timestamp_seconds"] == 1700000100.0
    assert m["sparkllm_watchdog_failures"] == 2.0
    assert m["sparkllm_guard_kills_total"] == 2.0
    assert m["sparkllm_guard_last_kill_timestamp_seconds"] == 1700000400.0
    # after the operator's start the watchdog clears gave_up; a broken file is reported, not guessed
    (ops / "watchdog.json").write_text('{"restarts": [], "gave_up": null, "failures": 0}')
    m = parse(exp.Collector(smi, meminfo, ops_state_dir=ops).collect())
    assert m["sparkllm_watchdog_gave_up"] == 0.0
    assert "sparkllm_watchdog_last_restart_timestamp_seconds" not in m
    (ops / "watchdog.json").write_text("{not json")
    m = parse(exp.Collector(smi, meminfo, ops_state_dir=ops).collect())
    assert m['sparkllm_ops_state_up{file="watchdog.json"}'] == 0.0 and "sparkllm_watchdog_gave_up" not in m
    # no state directory at all (spark_ops not installed)
    m = parse(exp.Collector(smi, meminfo, ops_state_dir=tmp_path / "none").collect())
    assert m['sparkllm_ops_state_up{file="guard-kills.log"}'] == 0.0


def test_smi_timeout_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert exp.main(["--once", "--smi-timeout", "0"]) == 2
    assert "--smi-timeout 0.0 must be a positive number" in capsys.readouterr().err
