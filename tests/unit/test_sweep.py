"""sweep.py: grid, interleaving, resume (fake runner) and one real ansible_runner.run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sweep
from spark_bench import spark_cell_hash

from tests.unit.bench_helpers import fake_doc, run_sweep_cell

SPEEDS = {"baseline": 10.0, "ngram": 9.0, "mtp-k1": 12.0, "mtp-k2": 14.0, "mtp-k4": 13.0}


class FakeRunner:
    """Stands in for ansible-runner: 'serves' and 'benches' by writing a run JSON to the results dir."""

    def __init__(self, fail_on: int | None = None, invalid: set[tuple[str, int]] | None = None) -> None:
        self.calls: list[sweep.RunRequest] = []
        self.fail_on = fail_on
        self.invalid = invalid or set()

    def __call__(self, req: sweep.RunRequest) -> sweep.RunOutcome:
        self.calls.append(req)
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise KeyboardInterrupt  # the user interrupts the sweep
        ev = req.extravars
        if req.tags == "cluster,serve,bench":
            label, rep = ev["bench_label"], ev["bench_repetition"]
            valid = (label, rep) not in self.invalid
            doc = fake_doc(label, rep, [SPEEDS[label] * (1 + 0.01 * rep)] * 3, valid=valid,
                           method=ev["spec_method"], config_hash=spark_cell_hash(ev["bench_cell"]),
                           run_id=f"run-{label}-{rep}-{len(self.calls)}")
            Path(ev["bench_results_dir"], f"{doc['run_id']}.json").write_text(json.dumps(doc))
        return sweep.RunOutcome(True, "successful", 0)

    def order(self) -> list[tuple[str, int]]:
        return [(c.extravars["bench_label"], c.extravars["bench_repetition"]) for c in self.calls]


def test_grid_and_hash() -> None:
    cfgs = sweep.expand_grid(["baseline", "mtp"], [1, 2], {})
    assert [c.label for c in cfgs] == ["baseline", "mtp-k1", "mtp-k2"]
    assert len({c.config_hash for c in cfgs}) == 3
    assert sweep.CellConfig("mtp", 2).config_hash == cfgs[2].config_hash
    assert sweep.expand_grid(["mtp"], [2], {"serve_gpu_memory_utilization": 0.85})[0].config_hash != \
        cfgs[2].config_hash
    with pytest.raises(sweep.UsageError, match="unknown method"):
        sweep.expand_grid(["medusa2"], [2], {})
    ev = cfgs[1].extravars(3, Path("/r"))
    assert ev["spec_method"] == "mtp" and ev["spec_num_speculative_tokens"] == 1
    assert ev["bench_repetition"] == 3 and ev["bench_label"] == "mtp-k1"
    assert "bench_config_hash" not in ev  # the role computes it from the cell's description
    assert spark_cell_hash(ev["bench_cell"]) == cfgs[1].config_hash


def test_interleaved_and_best(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeRunner()
    rc = sweep.main(["--methods", "baseline,ngram,mtp", "--mtp-k", "1,2", "--repeats", "2",
                     "--results", str(tmp_path / "res"), "--quiet", "--leave-best"], runner=fake)
    assert rc == 0
    labels = ["baseline", "ngram", "mtp-k1", "mtp-k2"]
    assert fake.order()[:-1] == [(lab, 1) for lab in labels] + [(lab, 2) for lab in labels]
    assert all(c.tags == "cluster,serve,bench" and c.playbook == "site.yml" for c in fake.calls[:-1])
    last = fake.calls[-1]
    assert last.tags == "cluster,serve" and last.extravars["spec_method"] == "mtp"
    assert last.extravars["spec_num_speculative_tokens"] == 2
    out = capsys.readouterr().out
    assert "best configuration: mtp-k2" in out
    assert (tmp_path / "res" / "report" / "report.md").exists()


def test_resume_skips_recorded_cells(tmp_path: Path) -> None:
    res = tmp_path / "res"
    args = ["--methods", "baseline,mtp", "--mtp-k", "2,4", "--repeats", "2", "--results", str(res), "--quiet"]
    first = FakeRunner(fail_on=4, invalid={("mtp-k2", 1)})
    with pytest.raises(KeyboardInterrupt):
        sweep.main(args, runner=first)
    assert first.order() == [("baseline", 1), ("mtp-k2", 1), ("mtp-k4", 1), ("baseline", 2)]
    second = FakeRunner()
    assert sweep.main(args, runner=second) == 0
    # baseline/1 and mtp-k4/1 are recorded valid; mtp-k2/1 was invalid -> retried; rep 2 resumes
    assert second.order() == [("mtp-k2", 1), ("baseline", 2), ("mtp-k2", 2), ("mtp-k4", 2)]
    third = FakeRunner()
    assert sweep.main(args, runner=third) == 0
    assert third.calls == []


def test_failed_cell_reported(tmp_path: Path) -> None:
    def failing(req: sweep.RunRequest) -> sweep.RunOutcome:
        return sweep.RunOutcome(False, "failed", 2)

    assert sweep.main(["--methods", "baseline", "--repeats", "1", "--results", str(tmp_path), "--quiet"],
                      runner=failing) == 1


def test_real_ansible_runner_wiring(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    site = (f"""---
- name: Tiny site
  hosts: all
  gather_facts: false
  tasks:
    - name: Serve stage
      ansible.builtin.copy:
        dest: "{tmp_path}/serve.txt"
        content: "{{{{ spec_method }}}}"
        mode: "0644"
      tags: [serve]
    - name: Bench stage
      ansible.builtin.copy:
        dest: "{out}"
        content: "{{{{ bench_label }}}} {{{{ bench_repetition }}}} {{{{ bench_cell | to_json }}}}"
        mode: "0644"
      tags: [bench]
    - name: Untagged stage must not run
      ansible.builtin.copy:
        dest: "{tmp_path}/other.txt"
        content: "x"
        mode: "0644"
      tags: [build]
""")
    cfg, outcome = run_sweep_cell(tmp_path, site)
    assert outcome.ok, outcome
    label, rep, cell = out.read_text().split(" ", 2)
    assert (label, rep) == ("mtp-k2", "1") and spark_cell_hash(json.loads(cell)) == cfg.config_hash
    assert (tmp_path / "serve.txt").read_text() == "mtp"
    assert not (tmp_path / "other.txt").exists()


def test_k_per_method_checked_against_the_catalogue(tmp_path: Path) -> None:
    cat = sweep.load_settings()["spark_method_catalogue"]
    ks = sweep.parse_k(["mtp=1,3", "dflash=5,12"], cat)
    cfgs = sweep.expand_grid(["baseline", "mtp", "dflash"], [2], {}, list(cat), ks)
    assert [c.label for c in cfgs] == ["baseline", "mtp-k1", "mtp-k3", "dflash-k5", "dflash-k12"]
    lo, hi = sweep.spec_tokens_range()
    for bad, needle in ([f"mtp={hi + 1}"], "must be in"), (["baseline=2"], "takes no K"), \
            (["medusa=2"], "unknown method"), (["mtp=x"], "integers"):
        with pytest.raises(sweep.UsageError, match=needle):
            sweep.parse_k(bad, cat)
