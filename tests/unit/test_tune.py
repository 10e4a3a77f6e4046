"""tune.py (`make tune`): the grid, the time estimate and the resume, with a fake runner (no Ansible)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sweep
import tune
from spark_bench import spark_cell_hash

from tests.unit.bench_helpers import fake_doc

KNOWN = ["baseline", "ngram", "mtp", "eagle3", "dflash"]
SPEEDS = {"baseline": 10.0, "mtp-k2": 14.0, "dflash-k8": 19.0}
# the settings a deploy with dflash built has (its vLLM variant is provided), so every method can be tuned
BUILT = ["--extra-vars", json.dumps({"vllm_build_methods": ["dflash"]})]


class FakeRunner:
    """Stands in for ansible-runner: writes a run document for every measured cell."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[sweep.RunRequest] = []
        self.stop_at = stop_at

    def __call__(self, req: sweep.RunRequest) -> sweep.RunOutcome:
        self.calls.append(req)
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        ev = req.extravars
        if req.tags == sweep.MEASURE_TAGS:
            label, rep = ev["bench_label"], ev["bench_repetition"]
            doc = fake_doc(label, rep, [SPEEDS[label]] * 3, method=ev["spec_method"],
                           config_hash=spark_cell_hash(ev["bench_cell"]),
                           run_id=f"run-{label}-{len(self.calls)}")
            Path(ev["bench_results_dir"], f"{doc['run_id']}.json").write_text(json.dumps(doc))
        return sweep.RunOutcome(True, "successful", 0)

    def measured(self) -> list[str]:
        return [c.extravars["bench_label"] for c in self.calls if c.tags == sweep.MEASURE_TAGS]


def test_the_default_grid_is_method_x_k_x_head_with_a_baseline_per_head():
    cfgs = tune.build_grid(["mtp", "dflash"], ["int8", "bf16"], False, {}, KNOWN)
    labels = [c.label for c in cfgs]
    assert labels == ["baseline", "mtp-k1", "mtp-k2", "mtp-k3", "dflash-k5", "dflash-k8", "dflash-k12",
                      "baseline", "mtp-k1-bf16head", "mtp-k2-bf16head", "mtp-k3-bf16head",
                      "dflash-k5-bf16head", "dflash-k8-bf16head", "dflash-k12-bf16head"]
    assert len({c.config_hash for c in cfgs}) == 14  # the head is part of the served configuration
    ev = [json.loads(c.extra_vars_json) for c in cfgs]
    assert all(e["bench_profile"] == "records" for e in ev)
    assert [e["vllm_lm_head_int8"] for e in ev] == [True] * 7 + [False] * 7
    # the tag names a configuration but does not change what is served
    assert cfgs[8].config_hash == sweep.CellConfig("mtp", 1, cfgs[8].extra_vars_json).config_hash


def test_quick_and_methods_narrow_the_grid_and_baseline_is_always_in():
    quick = tune.build_grid(["mtp", "dflash"], ["int8"], True, {}, KNOWN)
    assert [c.label for c in quick] == ["baseline", "mtp-k2", "dflash-k8"]
    assert [c.label for c in tune.build_grid(["dflash"], ["bf16"], False, {}, KNOWN)] == \
        ["baseline", "dflash-k5-bf16head", "dflash-k8-bf16head", "dflash-k12-bf16head"]


def test_the_estimate_adds_a_start_and_the_token_limits_at_each_methods_expected_speed():
    per_pass = tune.tokens_per_pass()
    assert per_pass == 256 + 512 + 1024 + 64 + 2048  # the records prompts' limits
    cells = sweep.schedule(tune.build_grid(["mtp"], ["int8"], True, {}, KNOWN), 2)
    est = tune.estimate(cells, 4, 1000, start_s=100)
    want = 2 * (100 + 4000 / tune.EXPECTED_TOK_S["baseline"]) + 2 * (100 + 4000 / tune.EXPECTED_TOK_S["mtp"])
    assert est.cells == 4 and est.seconds == pytest.approx(want)
    assert tune.estimate([], 4, 1000).seconds == 0
    assert "about 0 h 09 min" in tune.Estimate(1, 540, 4, 1000, 100).lines()[0]


def test_tune_prints_its_estimate_resumes_and_leaves_the_fastest_checked_config(tmp_path, capsys):
    args = ["--quick", "--results", str(tmp_path / "res"), "--quiet", "--inventory", "localhost,", *BUILT]
    first = FakeRunner(stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        tune.main(args, runner=first)
    assert first.measured() == ["baseline", "mtp-k2", "dflash-k8"]
    assert "estimate: 3 cells to run" in capsys.readouterr().out
    second = FakeRunner()
    assert tune.main(args, runner=second) == 0
    out = capsys.readouterr().out
    assert "estimate: 1 cells to run" in out  # the two recorded cells are neither estimated nor run
    assert second.measured() == ["dflash-k8"]
    assert "fastest lossless configuration: dflash-k8 (spec_method=dflash, spec_num_speculative_tokens=8, " \
           "INT8 LM head)" in out
    last = second.calls[-1]
    assert last.tags == sweep.SERVE_TAGS and last.extravars["spec_num_speculative_tokens"] == 8
    assert last.extravars["vllm_lm_head_int8"] is True and last.extravars["bench_profile"] == "records"


def test_dry_run_runs_nothing_and_bad_input_is_a_usage_error(tmp_path, capsys):
    fake = FakeRunner()
    assert tune.main(["--dry-run", "--results", str(tmp_path), "--inventory", "localhost,", *BUILT],
                     runner=fake) == 0
    assert fake.calls == [] and "estimate: 14 cells to run" in capsys.readouterr().out
    for bad in (["--methods", "medusa"], ["--heads", "fp4"], ["--repeats", "0"], ["--extra-vars", "[]"]):
        assert tune.main([*bad, "--dry-run", "--inventory", "localhost,"], runner=fake) == 2
