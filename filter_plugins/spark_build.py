"""Build parallelism of the vLLM compile (roles/vllm_build): how many nvcc processes fit the memory.

``spark_build_jobs(meminfo, cores, gib_per_thread, nvcc_threads, reserve_gib, fixed_max_jobs=0)``

- ``meminfo``: the text of /proc/meminfo (MemAvailable is used: what the compile can take without pushing
  out a running server or the model download beside it; MemTotal when a kernel has no MemAvailable);
- ``cores``: the CPUs the build may use (nproc);
- ``gib_per_thread``: peak memory of one nvcc compilation thread (GiB);
- ``nvcc_threads``: NVCC_THREADS, threads per nvcc process (vLLM passes ``--threads`` to nvcc);
- ``reserve_gib``: memory left to everything else (GiB);
- ``fixed_max_jobs``: a MAX_JOBS the user fixed (> 0), used as it is.

Returns ``{"max_jobs", "nvcc_threads", "processes", "mem_available_gib", "bound"}``:

    processes = max(1, min(cores // nvcc_threads,
                           floor((mem_available_gib - reserve_gib) / (gib_per_thread * nvcc_threads))))
    max_jobs  = processes * nvcc_threads

``max_jobs`` is what the build passes as MAX_JOBS: vLLM's setup.py (``compute_num_jobs``, 0.19.1
setup.py:158-195, the same in 0.26.0) divides MAX_JOBS by NVCC_THREADS to get ninja's job count, so
MAX_JOBS counts threads, not processes. ``bound`` says which limit decided (``cores``, ``memory`` or
``fixed``). Bad input raises a one-line error naming the knob.
"""

from __future__ import annotations

import math
import re

from ansible.errors import AnsibleFilterError

_KB = re.compile(r"^(MemAvailable|MemTotal):\s+(\d+)\s+kB\s*$", re.M)


def _positive(value, name: str, kind=float, minimum=0.0, strict=True):
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise AnsibleFilterError(
            f"spark_build_jobs: {name}={value!r} is not a number; set it to a positive value") from None
    too_small = number <= minimum if strict else number < minimum
    if isinstance(value, bool) or not math.isfinite(number) or too_small:
        raise AnsibleFilterError(
            f"spark_build_jobs: {name}={value!r} must be {'>' if strict else '>='} {minimum}")
    return number


def mem_available_gib(meminfo: str) -> float:
    """MemAvailable (else MemTotal) of a /proc/meminfo text, in GiB."""
    if not isinstance(meminfo, str):
        raise AnsibleFilterError("spark_build_jobs: meminfo must be the text of /proc/meminfo")
    found = dict(_KB.findall(meminfo))
    kb = found.get("MemAvailable", found.get("MemTotal"))
    if kb is None:
        raise AnsibleFilterError("spark_build_jobs: no MemAvailable or MemTotal line in the meminfo given "
                                 "(expected the text of /proc/meminfo)")
    return int(kb) / (1024 * 1024)


def spark_build_jobs(meminfo, cores, gib_per_thread, nvcc_threads, reserve_gib, fixed_max_jobs=0) -> dict:
    available = mem_available_gib(meminfo)
    cores = int(_positive(cores, "cores (processor_nproc)", int, 0))
    per_thread = _positive(gib_per_thread, "vllm_build_gib_per_job")
    threads = int(_positive(nvcc_threads, "vllm_build_nvcc_threads", int, 0))
    reserve = _positive(reserve_gib, "vllm_build_memory_reserve_gib", float, 0.0, strict=False)
    fixed = int(_positive(fixed_max_jobs, "vllm_build_max_jobs", int, 0.0, strict=False))
    if fixed > 0:
        return {"max_jobs": fixed, "nvcc_threads": threads, "processes": max(1, fixed // threads),
                "mem_available_gib": round(available, 1), "bound": "fixed"}
    by_cores = max(1, cores // threads)
    by_memory = max(1, math.floor(max(0.0, available - reserve) / (per_thread * threads)))
    processes = min(by_cores, by_memory)
    return {"max_jobs": processes * threads, "nvcc_threads": threads, "processes": processes,
            "mem_available_gib": round(available, 1), "bound": "cores" if by_cores <= by_memory else "memory"}


class FilterModule:
    def filters(self):
        return {"spark_build_jobs": spark_build_jobs}
