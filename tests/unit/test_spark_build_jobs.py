"""filter_plugins/spark_build.py: the compile's parallelism from MemAvailable, the cores and NVCC_THREADS."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from spark_build import mem_available_gib, spark_build_jobs


def meminfo(avail_gib: float | None, total_gib: float = 121.7) -> str:
    lines = [f"MemTotal:       {int(total_gib * 1024 * 1024)} kB", "MemFree:         1000 kB"]
    if avail_gib is not None:
        lines.append(f"MemAvailable:   {int(avail_gib * 1024 * 1024)} kB")
    return "\n".join(lines + ["Buffers:           10 kB", ""])


def test_spark_idle_is_bound_by_its_cores():
    """A Spark with nothing else running: ~112 GiB available of 121.7 GiB (128 GB), 20 cores."""
    jobs = spark_build_jobs(meminfo(112.0), 20, 4, 1, 16)
    # (112 - 16) // 4 = 24 processes fit in memory; 20 cores
    assert jobs == {"max_jobs": 20, "nvcc_threads": 1, "processes": 20, "mem_available_gib": 112.0,
                    "bound": "cores"}


def test_spark_beside_a_running_server_is_bound_by_memory():
    """A rebuild while the 122B server holds ~95 GiB: MemAvailable 26 GiB -> (26 - 16) // 4 = 2."""
    jobs = spark_build_jobs(meminfo(26.0), 20, 4, 1, 16)
    assert (jobs["processes"], jobs["max_jobs"], jobs["bound"]) == (2, 2, "memory")


def test_max_jobs_counts_threads_because_vllm_divides_it_by_nvcc_threads():
    """vLLM's setup.py: ninja jobs = MAX_JOBS // NVCC_THREADS. 2 threads per process, memory for 24
    threads -> 12 processes -> MAX_JOBS 24 (vLLM then runs 12), capped by cores: 20 // 2 = 10."""
    jobs = spark_build_jobs(meminfo(112.0), 20, 4, 2, 16)
    assert (jobs["processes"], jobs["max_jobs"], jobs["bound"]) == (10, 20, "cores")
    jobs = spark_build_jobs(meminfo(64.0), 20, 4, 2, 16)  # (64 - 16) // 8 = 6
    assert (jobs["processes"], jobs["max_jobs"], jobs["bound"]) == (6, 12, "memory")


def test_never_below_one_job():
    jobs = spark_build_jobs(meminfo(3.0), 20, 4, 1, 16)
    assert (jobs["processes"], jobs["max_jobs"]) == (1, 1)
    assert spark_build_jobs(meminfo(500.0), 1, 4, 4, 16)["processes"] == 1  # 1 core, 4 threads


def test_memtotal_when_the_kernel_has_no_memavailable():
    assert mem_available_gib(meminfo(None, total_gib=64.0)) == pytest.approx(64.0)


def test_a_fixed_max_jobs_is_used_as_it_is():
    jobs = spark_build_jobs(meminfo(112.0), 20, 4, 2, 16, 7)
    assert (jobs["max_jobs"], jobs["processes"], jobs["bound"]) == (7, 3, "fixed")


@pytest.mark.parametrize(("args", "needle"), [
    (("MemFree: 1 kB\n", 20, 4, 1, 16), "no MemAvailable or MemTotal line"),
    ((None, 20, 4, 1, 16), "meminfo must be the text of /proc/meminfo"),
    ((meminfo(100), 0, 4, 1, 16), "cores (processor_nproc)=0 must be > 0"),
    ((meminfo(100), 20, 0, 1, 16), "vllm_build_gib_per_job=0 must be > 0"),
    ((meminfo(100), 20, "lots", 1, 16), "vllm_build_gib_per_job='lots' is not a number"),
    ((meminfo(100), 20, 4, 0, 16), "vllm_build_nvcc_threads=0 must be > 0"),
    ((meminfo(100), 20, 4, 1, -1), "vllm_build_memory_reserve_gib=-1 must be >= 0"),
    ((meminfo(100), 20, 4, 1, 16, -2), "vllm_build_max_jobs=-2 must be >= 0"),
    ((meminfo(100), 20, True, 1, 16), "vllm_build_gib_per_job=True must be > 0"),
])
def test_bad_input_names_the_knob(args, needle):
    with pytest.raises(AnsibleFilterError, match=None) as err:
        spark_build_jobs(*args)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)
