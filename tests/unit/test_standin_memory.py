"""The stand-in's start-up reservation (tests/fixtures/standin_server/memory.py), run as the images run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.fixtures.standin_server import memory

SERVER = Path(__file__).resolve().parents[1] / "fixtures" / "standin_server" / "server.py"


def _meminfo(tmp_path: Path, total_mib: int, avail_mib: int) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       {total_mib * 1024} kB\nMemAvailable:   {avail_mib * 1024} kB\n")
    return p


def test_reserve_takes_utilization_of_memtotal(tmp_path):
    buf = memory.reserve(0.25, str(_meminfo(tmp_path, 64, 60)))
    assert len(buf) == 16 << 20 and buf[4096] == 1


def test_reserve_is_off_without_meminfo_or_utilization(tmp_path, monkeypatch):
    monkeypatch.delenv("STANDIN_MEMINFO", raising=False)
    assert memory.reserve(0.85) == bytearray()
    assert memory.reserve(None, str(_meminfo(tmp_path, 64, 60))) == bytearray()


def test_shortage_is_refused_with_vllms_message(tmp_path):
    try:
        memory.reserve(0.5, str(_meminfo(tmp_path, 2048, 900)))
    except memory.ReservationError as e:
        msg = str(e)
    else:
        raise AssertionError("a 1024 MiB request with 900 MiB available was not refused")
    assert msg == ("Free memory on device cuda:0 (0.88/2.0 GiB) on startup is less than desired GPU memory "
                   "utilization (0.5, 1.0 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
                   "other processes.")
    # exactly the request fits (vLLM: free < requested refuses)
    assert memory.shortage_message(1 << 30, 2 << 30, 0.5) is None


def test_the_script_fails_at_start_like_vllm(tmp_path):
    env = {"STANDIN_MEMINFO": str(_meminfo(tmp_path, 2048, 900)), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(SERVER), "serve", "/model", "--port", "0",
                           "--gpu-memory-utilization", "0.5"], env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ValueError: Free memory on device cuda:0 (0.88/2.0 GiB) on startup" in proc.stderr
    assert "Engine core initialization failed" in proc.stderr
    assert "stand-in serving" not in proc.stdout
