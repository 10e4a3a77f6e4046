"""Unit tests for filter_plugins/spark_postmortem.py: the failure message's traceback and memory."""

from __future__ import annotations

import pytest
from spark_postmortem import FilterModule, spark_first_traceback, spark_meminfo_summary

P = "(EngineCore_DP0 pid=180) ERROR 11-30 17:03:44 [core.py:843] "
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
       "capacity of 119.70 GiB of which 1.12 GiB is free.")
# A vLLM start that fails in the engine: the root cause, then multiprocessing's copy, then the API
# server's own traceback, then teardown (what the journal's tail shows).
VLLM_JOURNAL = [
    "(APIServer pid=1) INFO 11-30 17:01:02 [api_server.py:1350] vLLM API server version 0.19.1",
    "(EngineCore_DP0 pid=180) INFO 11-30 17:01:20 [core.py:97] Initializing a V1 LLM engine (v0.19.1)",
    P + "EngineCore failed to start.",
    P + "Traceback (most recent call last):",
    P + '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 834, in run',
    P + "    engine_core = EngineCoreProc(*args, **kwargs)",
    P + "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    P + '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu_worker.py", line 260, in profile',
    P + "    self.model_runner.profile_run()",
    P + OOM,
    "(EngineCore_DP0 pid=180) Process EngineCore_DP0:",
    "(EngineCore_DP0 pid=180) Traceback (most recent call last):",
    '(EngineCore_DP0 pid=180)   File "/usr/lib/python3.12/multiprocessing/process.py", line 314, in run',
    "(EngineCore_DP0 pid=180) " + OOM,
    "(APIServer pid=1) Traceback (most recent call last):",
    '(APIServer pid=1)   File "/usr/local/bin/vllm", line 10, in <module>',
    "(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above.",
    "sparkllm-vllm-mtp.service: Main process exited, code=exited, status=1/FAILURE",
]


def test_first_engine_core_traceback_without_prefixes():
    result = spark_first_traceback(VLLM_JOURNAL)
    assert result["found"] == "EngineCore"
    lines = result["text"].splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == OOM
    assert len(lines) == 7
    assert "pid=180" not in result["text"]
    assert "Engine core initialization failed" not in result["text"]


def test_text_input_and_an_earlier_unrelated_traceback():
    journal = ["(APIServer pid=1) WARNING 11-30 17:00:00 [x.py:1] optional import failed",
               "(APIServer pid=1) Traceback (most recent call last):",
               '(APIServer pid=1)   File "x.py", line 1, in <module>',
               "(APIServer pid=1) ImportError: no module named flashinfer_cubin"] + VLLM_JOURNAL
    result = spark_first_traceback("\n".join(journal))
    assert result["found"] == "EngineCore"
    assert result["text"].splitlines()[-1] == OOM


def test_unprefixed_multiprocessing_traceback_after_the_process_line():
    journal = ["INFO starting", "Process EngineCore_DP0:", "Traceback (most recent call last):",
               '  File "core.py", line 1, in run', "    boom()", "ValueError: bad block size",
               "INFO shutting down"]
    result = spark_first_traceback(journal)
    assert result == {"found": "EngineCore", "text": "\n".join(journal[2:6])}


def test_chained_exception_is_kept():
    journal = ["Process EngineCore_DP0:", "Traceback (most recent call last):", '  File "a.py", line 1, in f',
               "KeyError: 'w'", "", "The above exception was the direct cause of the following exception:",
               "", "Traceback (most recent call last):", '  File "b.py", line 2, in g',
               "RuntimeError: weight not found", "INFO next record"]
    text = spark_first_traceback(journal)["text"]
    assert text.startswith("Traceback") and "KeyError: 'w'" in text
    assert text.endswith("RuntimeError: weight not found")
    assert "INFO next record" not in text


def test_other_traceback_or_none():
    other = ["(APIServer pid=1) Traceback (most recent call last):", '(APIServer pid=1)   File "x", line 1',
             "(APIServer pid=1) OSError: port in use"]
    assert spark_first_traceback(other) == {
        "found": "other",
        "text": 'Traceback (most recent call last):\n  File "x", line 1\nOSError: port in use'}
    assert spark_first_traceback(["all fine", "stopped"]) == {"found": "", "text": ""}
    assert spark_first_traceback(None) == {"found": "", "text": ""}


def test_long_traceback_keeps_head_and_tail():
    frames = [f'  File "f{i}.py", line {i}, in f' for i in range(200)]
    journal = ["EngineCore failed to start.", "Traceback (most recent call last):", *frames, "OSError: end"]
    lines = spark_first_traceback(journal, max_lines=20)["text"].splitlines()
    assert len(lines) == 20
    assert lines[0].startswith("Traceback") and lines[-1] == "OSError: end"
    assert "lines left out" in lines[5]


MEMINFO = """MemTotal:       125515776 kB
MemFree:         1048576 kB
MemAvailable:    2097152 kB
Buffers:           10240 kB
Cached:         62914560 kB
Shmem:             65536 kB
SwapTotal:       16777216 kB
SwapFree:        16777216 kB
HugePages_Total:       0
"""


def test_meminfo_summary():
    assert spark_meminfo_summary(MEMINFO) == (
        "MemTotal 119.7 GiB, MemAvailable 2.0 GiB, MemFree 1.0 GiB, Cached 60.0 GiB, Shmem 0.1 GiB, "
        "SwapTotal 16.0 GiB, SwapFree 16.0 GiB, HugePages_Total 0")


@pytest.mark.parametrize("bad", ["", None, "garbage\nnot: meminfo kB kB"])
def test_meminfo_summary_without_figures(bad):
    assert spark_meminfo_summary(bad) == "(no /proc/meminfo figures)"


def test_filters_registered():
    filters = FilterModule().filters()
    assert filters["spark_first_traceback"] is spark_first_traceback
    assert filters["spark_meminfo_summary"] is spark_meminfo_summary


def test_standin_failure_output_gives_the_engine_core_cause():
    """The molecule serve scenario's failing unit (STANDIN_FAIL=1) logs like vLLM; the cause is found."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    server = Path(__file__).resolve().parents[1] / "fixtures" / "standin_server" / "server.py"
    proc = subprocess.run([sys.executable, str(server), "serve", "/model", "--port", "0"],
                          capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, STANDIN_FAIL="1"), check=False)
    assert proc.returncode != 0
    result = spark_first_traceback(proc.stderr)
    assert result["found"] == "EngineCore"
    last = result["text"].splitlines()[-1]
    assert last == "torch.OutOfMemoryError: stand-in: CUDA out of memory (STANDIN_FAIL=1)"
