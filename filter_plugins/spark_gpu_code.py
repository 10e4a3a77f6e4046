"""Judge the GPU code of a built or pulled vLLM image against what its variant should carry.

The post-build check (roles/vllm_build/tasks/checks.yml) lists, in a one-shot container of the
image, every compiled vLLM extension (``_C*.so``, ``_moe_C*.so``)::

    == /opt/venv/.../vllm/_C.abi3.so
    ELF file    1: _C.abi3.1.sm_121a.cubin
    ...
    marlin: sm12x-sass=936 ptx=746

(``cuobjdump --list-elf``, then the number of Marlin kernels that have SM12x SASS and that exist as
PTX). ``spark_gpu_code_judge`` compares that with the variant's expectation
(``spark_vllm_variants.<v>.gpu_code.<source|wheel>``: the SASS that release's CMake makes for our arch
list, or that the pinned wheel carries; tests/contract/test_build_arch_contract.py derives both from
the real sources and the wheel listing). A blanket ``sm_121`` would fail a correct 0.26.0 image (its
CMake caps CUDA 13 at 12.0, so 12.1a yields sm_120 code, which GB10 runs).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_SECTION = re.compile(r"(?m)^== (.+)$")
_ARCH = re.compile(r"\bsm_[0-9]+[af]?\b")
_MARLIN = re.compile(r"(?m)^marlin: sm12x-sass=(\d+) ptx=(\d+)\s*$")


def _sections(listing: str) -> list[tuple[str, str]]:
    parts = _SECTION.split("\n" + (listing or ""))
    return [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def spark_gpu_code_judge(listing: str, expect: Mapping[str, Any]) -> dict[str, Any]:
    """{"files", "archs", "missing", "marlin_ptx_only", "problems"} of one arch-check listing.

    ``expect``: ``sass`` (an arch or a list of archs; each library must carry at least one of them)
    and ``marlin_ptx_only_accepted`` (true: a library whose Marlin kernels are PTX only on SM12x is
    recorded as accepted, else it is a problem naming the family).
    """
    wanted = expect.get("sass") or []
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    if not wanted:
        raise ValueError("gpu_code expectation has no sass: set spark_vllm_variants.<variant>.gpu_code "
                         "or vllm_build_expect_arch")
    files, missing, ptx_only, archs = [], [], [], set()
    for path, body in _sections(listing):
        name = path.rsplit("/", 1)[-1]
        files.append(name)
        found = set(_ARCH.findall(body))
        archs |= found
        if not found & set(wanted):
            missing.append(name)
        m = _MARLIN.search(body)
        if m and int(m.group(2)) > 0 and int(m.group(1)) == 0:
            ptx_only.append(name)
    problems = []
    if not files:
        problems.append("no compiled vLLM extension was found")
    if missing:
        problems.append(f"no {' or '.join(wanted)} code in {', '.join(missing)}")
    if ptx_only and not expect.get("marlin_ptx_only_accepted", False):
        problems.append(f"the Marlin kernels (INT4 dense/MoE, our hot path) are PTX only on SM12x in "
                        f"{', '.join(ptx_only)}: the driver JIT-compiles them at every cold start")
    return {"files": files, "archs": sorted(archs), "missing": missing, "marlin_ptx_only": ptx_only,
            "problems": problems}


class FilterModule:
    def filters(self):
        return {"spark_gpu_code_judge": spark_gpu_code_judge}
