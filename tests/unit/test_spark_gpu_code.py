"""filter_plugins/spark_gpu_code.py on small arch-check listings."""

from __future__ import annotations

import pytest
from spark_gpu_code import spark_gpu_code_judge

C = "/opt/venv/lib/python3.12/site-packages/vllm/_C.abi3.so"
MOE = "/opt/venv/lib/python3.12/site-packages/vllm/_moe_C.abi3.so"


def listing(*libs: tuple[str, list[str], tuple[int, int] | None]) -> str:
    out = []
    for path, archs, marlin in libs:
        out.append(f"== {path}")
        out += [f"ELF file {i}: _C.abi3.{i}.{a}.cubin" for i, a in enumerate(archs, 1)]
        if marlin:
            out.append(f"marlin: sm12x-sass={marlin[0]} ptx={marlin[1]}")
    return "\n".join(out) + "\n"


def test_sm120_listing_passes_an_sm120_table_and_fails_a_blanket_sm121():
    text = listing((C, ["sm_100", "sm_120"], (936, 14)), (MOE, ["sm_120"], None))
    assert spark_gpu_code_judge(text, {"sass": "sm_120"})["problems"] == []
    bad = spark_gpu_code_judge(text, {"sass": "sm_121"})
    assert bad["missing"] == ["_C.abi3.so", "_moe_C.abi3.so"]
    assert bad["problems"] == ["no sm_121 code in _C.abi3.so, _moe_C.abi3.so"]


def test_one_of_several_archs_is_enough_per_library():
    text = listing((C, ["sm_121a"], None), (MOE, ["sm_120"], None))
    assert spark_gpu_code_judge(text, {"sass": ["sm_121a", "sm_120"]})["problems"] == []
    assert spark_gpu_code_judge(text, {"sass": "sm_121a"})["missing"] == ["_moe_C.abi3.so"]


def test_marlin_ptx_only_fails_naming_marlin_and_the_library_unless_accepted():
    text = listing((C, ["sm_121a"], (0, 746)))
    judged = spark_gpu_code_judge(text, {"sass": "sm_121a"})
    assert judged["marlin_ptx_only"] == ["_C.abi3.so"]
    (problem,) = judged["problems"]
    assert "Marlin" in problem and "_C.abi3.so" in problem
    accepted = spark_gpu_code_judge(text, {"sass": "sm_121a", "marlin_ptx_only_accepted": True})
    assert accepted["problems"] == []


def test_some_marlin_sass_is_not_ptx_only():
    text = listing((C, ["sm_121a"], (204, 731)))
    assert spark_gpu_code_judge(text, {"sass": "sm_121a"})["problems"] == []


def test_no_extension_is_a_problem_and_no_expectation_an_error():
    none = spark_gpu_code_judge("", {"sass": "sm_120"})
    assert none["problems"] == ["no compiled vLLM extension was found"]
    with pytest.raises(ValueError, match="gpu_code"):
        spark_gpu_code_judge(listing((C, ["sm_120"], None)), {})


FA2 = "/opt/venv/lib/python3.12/site-packages/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"


def _with_ptx(text: str, lib: str, ptx: str) -> str:
    """Add a ``ptx:`` line to one library's section of a listing."""
    head = f"== {lib}\n"
    before, after = text.split(head, 1)
    body, sep, rest = after.partition("\n== ")
    return before + head + body + f"ptx: {ptx}\n" + (sep + rest if sep else "")


def test_fa2_as_ptx_only_is_named_and_passes_only_when_the_variant_accepts_it():
    """0.26.0's wheel: FA2 (DFlash's FLASH_ATTN) is sm_80 SASS + compute_80 PTX: GB10 runs it from PTX."""
    text = listing((C, ["sm_120"], (936, 14)), (MOE, ["sm_120"], None), (FA2, ["sm_80"], None))
    text = _with_ptx(_with_ptx(text, FA2, "compute_80"), C, "compute_80")
    plain = spark_gpu_code_judge(text, {"sass": "sm_120"})
    assert plain["missing"] == ["_vllm_fa2_C.abi3.so"] and plain["ptx_only"] == ["_vllm_fa2_C.abi3.so"]
    ok = spark_gpu_code_judge(text, {"sass": "sm_120", "ptx_only_accepted": ["_vllm_fa2_C"]})
    assert ok["problems"] == [] and ok["ptx_only"] == ["_vllm_fa2_C.abi3.so"]  # still named
    # accepted as PTX only means it must carry PTX: an FA2 without any is missing GB10 code altogether
    bare = listing((C, ["sm_120"], None), (FA2, ["sm_80"], None))
    judged = spark_gpu_code_judge(bare, {"sass": "sm_120", "ptx_only_accepted": ["_vllm_fa2_C"]})
    assert judged["missing"] == ["_vllm_fa2_C.abi3.so"] and judged["ptx_only"] == []
    # acceptance is per library: _C itself never passes on PTX alone
    c_ptx = _with_ptx(listing((C, ["sm_80"], None)), C, "compute_80")
    only_fa2 = {"sass": "sm_120", "ptx_only_accepted": ["_vllm_fa2_C"]}
    assert spark_gpu_code_judge(c_ptx, only_fa2)["missing"] == ["_C.abi3.so"]
