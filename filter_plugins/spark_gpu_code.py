"""Judge the GPU code of a built or pulled vLLM image against what its variant should carry.

The post-build check (roles/vllm_build/tasks/checks.yml) lists, in a one-shot container of the
image, every compiled vLLM extension (``_C*.so``, ``_moe_C*.so``)::

    == /opt/venv/.../vllm/_C.abi3.so
    ELF file    1: _C.abi3.1.sm_121a.cubin
    ...
    marlin: sm12x-sass=936 ptx=746

    ptx: compute_80

(``cuobjdump --list-elf``, the number of Marlin kernels that have SM12x SASS and that exist as PTX, and
the PTX architectures the library embeds). Besides ``_C*``/``_moe_C*`` the check lists FlashAttention 2
(``vllm_flash_attn/_vllm_fa2_C*``, the FLASH_ATTN backend DFlash serves with): vllm-flash-attn builds it for
``8.0+PTX`` only, so on GB10 it runs as driver-compiled PTX; a variant records that as accepted, with its
reason, in ``gpu_code.<mode>.ptx_only_accepted``. ``spark_gpu_code_judge`` compares that with the variant's
expectation
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
_PTX = re.compile(r"(?m)^ptx:(.*)$")
_GB10 = re.compile(r"^sm_12[01][af]?$")


def _sections(listing: str) -> list[tuple[str, str]]:
    parts = _SECTION.split("\n" + (listing or ""))
    return [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def spark_gpu_code_judge(listing: str, expect: Mapping[str, Any]) -> dict[str, Any]:
    """{"files", "archs", "missing", "marlin_ptx_only", "ptx_only", "problems"} of one arch-check listing.

    ``expect``: ``sass`` (an arch or a list of archs; each library must carry at least one of them),
    ``marlin_ptx_only_accepted`` (true: a library whose Marlin kernels are PTX only on SM12x is
    recorded as accepted, else it is a problem naming the family) and ``ptx_only_accepted`` (library
    stems, e.g. ``_vllm_fa2_C``, that may carry no SM12x SASS as long as they carry PTX: GB10 runs them
    driver-compiled, once per image into the persisted CUDA cache). ``ptx_only`` names every library GB10
    can run only from PTX, accepted or not, so the build's summary says which kernels are JIT-compiled.
    """
    wanted = expect.get("sass") or []
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    if not wanted:
        raise ValueError("gpu_code expectation has no sass: set spark_vllm_variants.<variant>.gpu_code "
                         "or vllm_build_expect_arch")
    accepted = set(expect.get("ptx_only_accepted") or [])
    files, missing, marlin_ptx, ptx_only, archs = [], [], [], [], set()
    for path, body in _sections(listing):
        name = path.rsplit("/", 1)[-1]
        stem = name.split(".", 1)[0]
        files.append(name)
        found = set(_ARCH.findall(body))  # SASS (the ptx: line names compute_NN, never sm_NN)
        archs |= found
        p = _PTX.search(body)
        ptx = p.group(1).split() if p else []
        if ptx and not any(_GB10.match(a) for a in found):
            ptx_only.append(name)
        if not found & set(wanted) and not (stem in accepted and ptx):
            missing.append(name)
        m = _MARLIN.search(body)
        if m and int(m.group(2)) > 0 and int(m.group(1)) == 0:
            marlin_ptx.append(name)
    problems = []
    if not files:
        problems.append("no compiled vLLM extension was found")
    if missing:
        problems.append(f"no {' or '.join(wanted)} code in {', '.join(missing)}")
    if marlin_ptx and not expect.get("marlin_ptx_only_accepted", False):
        problems.append(f"the Marlin kernels (INT4 dense/MoE, our hot path) are PTX only on SM12x in "
                        f"{', '.join(marlin_ptx)}: the driver JIT-compiles them at every cold start")
    return {"files": files, "archs": sorted(archs), "missing": missing, "marlin_ptx_only": marlin_ptx,
            "ptx_only": ptx_only, "problems": problems}


class FilterModule:
    def filters(self):
        return {"spark_gpu_code_judge": spark_gpu_code_judge}
