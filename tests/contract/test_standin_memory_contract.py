"""The stand-in's start-up memory reservation against vLLM 0.19.1's own.

The stand-in: tests/fixtures/standin_server/memory.py.

vLLM requests ceil(total x gpu_memory_utilization) and refuses to start when free memory is below it
(``vllm/v1/worker/utils.py`` request_memory, called from gpu_worker.py's init_device); on GB10 (12.1) "free"
is psutil's available memory, i.e. MemAvailable (``vllm/utils/mem_utils.py``). The real function is run
here with the same figures the stand-in sees, so its condition and message cannot drift from vLLM's.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from tests.fixtures.standin_server import memory

pytestmark = pytest.mark.vllm_contract

GIB = 1 << 30
MIB = 1 << 20


def _vllm_request(free: int, total: int, util: float) -> tuple[int | None, str | None]:
    from vllm.v1.worker.utils import request_memory

    snap = SimpleNamespace(free_memory=free, total_memory=total, device_=memory.DEVICE)
    try:
        return request_memory(snap, SimpleNamespace(gpu_memory_utilization=util)), None
    except ValueError as e:
        return None, str(e)


@pytest.mark.parametrize(("total", "free", "util"), [
    (2048 * MIB, 900 * MIB, 0.5),          # molecule ops: refused
    (2048 * MIB, 1600 * MIB, 0.4),         # molecule ops: fits
    (2048 * MIB, 1024 * MIB, 0.5),         # exactly the request: fits (free < requested refuses)
    (125_519_668 * 1024, 20 * GIB, 0.85),  # a Spark with a desktop: refused
    (125_519_668 * 1024, 110 * GIB, 0.85),
    (24_683_664 * 1024, 7 * GIB, 0.3),
])
def test_the_standin_refuses_and_reserves_exactly_as_vllm(total, free, util):
    requested, error = _vllm_request(free, total, util)
    assert memory.shortage_message(free, total, util) == error
    if error is None:
        assert memory.requested_bytes(total, util) == requested


def test_free_memory_on_gb10_is_memavailable():
    from vllm.utils import mem_utils

    src = inspect.getsource(mem_utils.MemorySnapshot)
    assert "(12, 1)" in src and "psutil.virtual_memory().available" in src, \
        "0.19.1 no longer takes MemAvailable as free memory on GB10: revisit memory.py and spark_memory.py"
    assert mem_utils.format_gib(1536 * MIB) == memory.format_gib(1536 * MIB)


def test_the_worker_checks_at_start():
    from vllm.v1.worker import gpu_worker

    src = inspect.getsource(gpu_worker.Worker.init_device)
    assert "request_memory(init_snapshot, self.cache_config)" in src
