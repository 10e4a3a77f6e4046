"""Issue 44: the INT8 LM head moves logits slightly, so the outputs check compares a run served with it only
with a baseline served with the same head (run meta ``lm_head_int8``; a run without the key is BF16)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sparkllm.bench import analysis as bench_analysis

from tests.unit.test_bench_verdict import _doc, _rows, _store

INT8 = {"lm_head_int8": True}
# near-ties the INT8 head resolves the other way: the greedy text departs on a few prompts
NEAR_TIES = (3, 9, 15, 21, 27)


def test_an_int8_run_against_only_a_bf16_baseline_is_not_checked(tmp_path: Path) -> None:
    """Old store: BF16 baseline runs recorded before the key existed; a new INT8 mtp run whose text departs
    on 5 of 30 prompts is 'outputs not checked', never 'differ'."""
    store = _store(tmp_path, [_doc("baseline", 1, 10.0), _doc("baseline", 2, 10.0),
                              _doc("mtp-k2", 1, 14.0, wrong=NEAR_TIES, meta=INT8)])
    md, rows, stats = _rows(store)
    m = rows["mtp-k2"]
    assert m.outputs is None and m.differs is False
    assert bench_analysis.verdict_word(m, "baseline") == "not checked"
    assert bench_analysis.OUTPUTS_DIFFER not in md.split("## Recommendation")[1].split("\n## ")[0]
    assert "**outputs not checked**" in md and "vllm_lm_head_int8" in md
    # the checked-only choice (sweep --leave-best) passes over the faster, unchecked INT8 row
    assert bench_analysis.best_row(stats, 1, checked_only="baseline").label == "baseline"


def test_an_int8_run_is_checked_against_an_int8_baseline(tmp_path: Path) -> None:
    store = _store(tmp_path, [_doc("baseline", 1, 10.0, wrong=NEAR_TIES, meta=INT8),
                              _doc("baseline", 2, 10.0, wrong=NEAR_TIES, meta=INT8),
                              _doc("mtp-k2", 1, 14.0, wrong=NEAR_TIES, meta=INT8)])
    _, rows, _ = _rows(store)
    o = rows["mtp-k2"].outputs
    assert o is not None and o["compared"] == 30 and o["differing"] == 0 and not o["differs"]
    assert bench_analysis.verdict_word(rows["mtp-k2"], "baseline") == "same"


def test_an_int8_garbler_against_an_int8_baseline_still_differs(tmp_path: Path) -> None:
    store = _store(tmp_path, [_doc("baseline", 1, 10.0, meta=INT8), _doc("baseline", 2, 10.0, meta=INT8),
                              _doc("proxy-k2", 1, 20.0, wrong=tuple(range(0, 30, 5)), meta=INT8)])
    _, rows, _ = _rows(store)
    assert rows["proxy-k2"].differs and rows["proxy-k2"].outputs["differing"] == 6


def test_the_baseline_of_the_same_head_is_chosen_when_the_store_has_both(tmp_path: Path) -> None:
    """BF16 baseline runs (no key, an old store) and INT8 ones in the same context: the INT8 mtp row is
    compared with the INT8 baseline row, and a BF16 mtp row (key false) with the BF16 one."""
    bf16 = {"config_hash": "bf16bf16bf16"}
    int8 = {"config_hash": "int8int8int8", **INT8}
    docs = [_doc("baseline", r, 10.0, meta=bf16) for r in (1, 2, 3)]  # more runs: preferred by the speedup
    docs += [_doc("baseline", r, 10.0, wrong=NEAR_TIES, meta=int8) for r in (4, 5)]
    docs += [_doc("mtp-k2", 1, 14.0, wrong=NEAR_TIES, meta={"config_hash": "mtpint8", **INT8}),
             _doc("mtp-bf16", 1, 14.0, meta={"config_hash": "mtpbf16", "lm_head_int8": False})]
    _, rows, stats = _rows(store := _store(tmp_path, docs))
    assert store.is_dir()
    base = {bench_analysis.lm_head_int8(m): m.label for m in stats if m.base_label == "baseline"}
    assert set(base) == {False, True}
    o = rows["mtp-k2"].outputs
    assert o["baseline_row"] == base[True] and o["differing"] == 0 and not o["differs"]
    o = rows["mtp-bf16"].outputs
    assert o["baseline_row"] == base[False] and o["differing"] == 0 and not o["differs"]


@pytest.mark.parametrize("value,want", [(True, True), ("True", True), ("true", True), (False, False),
                                        ("False", False), (None, False)])
def test_the_meta_value_as_ansible_may_write_it(tmp_path: Path, value, want) -> None:
    meta = {} if value is None else {"lm_head_int8": value}
    _, rows, _ = _rows(_store(tmp_path, [_doc("mtp-k2", 1, 14.0, meta=meta)]))
    assert bench_analysis.lm_head_int8(rows["mtp-k2"]) is want
