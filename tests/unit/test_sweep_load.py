"""sweep.py with load points: concurrency levels and request rates in the resume key, the hash of one
served configuration whatever it is measured at, --optimise-rate and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sweep
from spark_bench import spark_cell_hash

from tests.unit.bench_helpers import fake_doc

SPEEDS = {"baseline": 10.0, "mtp-k2": 14.0}


class LoadRunner:
    """A fake ansible-runner that writes one run per load point the cell asks for (bench_concurrency,
    bench_request_rate); ``die_after`` runs in all it is interrupted (the sweep is killed mid-cell)."""

    def __init__(self, die_after: int | None = None) -> None:
        self.calls: list[sweep.RunRequest] = []
        self.written = 0
        self.die_after = die_after

    def __call__(self, req: sweep.RunRequest) -> sweep.RunOutcome:
        self.calls.append(req)
        ev = req.extravars
        if req.tags != "cluster,serve,bench":
            return sweep.RunOutcome(True, "successful", 0)
        points = [(int(c), None) for c in ev["bench_concurrency"].split(",") if c] + \
                 [(None, float(r)) for r in ev["bench_request_rate"].split(",") if r]
        for conc, rate in points:
            if self.die_after is not None and self.written >= self.die_after:
                raise KeyboardInterrupt
            label, rep = ev["bench_label"], ev["bench_repetition"]
            speed = SPEEDS[label] / (conc or 1)
            doc = fake_doc(label, rep, [speed] * 3, method=ev["spec_method"],
                           config_hash=spark_cell_hash(ev["bench_cell"]),
                           run_id=f"run-{label}-{rep}-c{conc}-r{rate}-{len(self.calls)}")
            doc["meta"]["concurrency"] = conc
            doc["meta"]["request_rate"] = rate
            if rate is not None:
                doc["meta"]["rate"] = {"request_rate": rate, "completed_rate_req_s": rate}
                doc["summary"]["goodput"] = {"share": 1.0, "rate_req_s": rate * speed / 20, "met": 3,
                                             "requests": 3}
            Path(ev["bench_results_dir"], f"{doc['run_id']}.json").write_text(json.dumps(doc))
            self.written += 1
        return sweep.RunOutcome(True, "successful", 0)

    def asked(self) -> list[tuple[str, str, str, bool]]:
        return [(c.extravars["bench_label"], c.extravars["bench_concurrency"],
                 c.extravars["bench_request_rate"], bool(c.extravars.get("bench_force")))
                for c in self.calls if c.tags == "cluster,serve,bench"]


def test_resume_runs_a_level_the_interrupted_cell_did_not(tmp_path: Path) -> None:
    """The first sweep dies after baseline measured concurrency 1 but not 2: the second must measure
    baseline at 2 (only), then mtp at every level; a third finds nothing left. With the old key
    (configuration hash + repetition) the second sweep skipped baseline's level 2."""
    args = ["--methods", "baseline,mtp", "--mtp-k", "2", "--repeats", "1", "--results", str(tmp_path / "res"),
            "--quiet", "--concurrency", "1,2", "--request-rate", "0.5,4"]
    with pytest.raises(KeyboardInterrupt):
        sweep.main(args, runner=LoadRunner(die_after=1))
    second = LoadRunner()
    assert sweep.main(args, runner=second) == 0
    assert second.asked() == [("baseline", "2", "0.5,4", True), ("mtp-k2", "1,2", "0.5,4", False)]
    third = LoadRunner()
    assert sweep.main(args, runner=third) == 0 and third.calls == []
    # one more rate: every cell runs only it
    fourth = LoadRunner()
    assert sweep.main([*args[:-1], "0.5,4,8"], runner=fourth) == 0
    assert fourth.asked() == [("baseline", "", "8", True), ("mtp-k2", "", "8", True)]


def test_load_lists_leave_the_configuration_hash_alone() -> None:
    plain = sweep.CellConfig("mtp", 2)
    loaded = sweep.expand_grid(["mtp"], [2], {"bench_concurrency": "1,2", "bench_request_rate": "1"},
                               known=["mtp"])[0]
    assert loaded.config_hash == plain.config_hash
    other = sweep.expand_grid(["mtp"], [2], {"bench_max_tokens": 64}, known=["mtp"])[0]
    assert other.config_hash != plain.config_hash


def test_optimise_rate_picks_the_best_goodput_and_leaves_it(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    fake = LoadRunner()
    rc = sweep.main(["--methods", "baseline,mtp", "--mtp-k", "2", "--repeats", "1", "--results",
                     str(tmp_path / "res"), "--quiet", "--request-rate", "1,2", "--optimise-rate", "2",
                     "--leave-best"], runner=fake)
    assert rc == 0
    assert fake.asked() == [("baseline", "", "1,2", False), ("mtp-k2", "", "1,2", False)]
    assert fake.calls[-1].tags == "cluster,serve" and fake.calls[-1].extravars["spec_method"] == "mtp"
    assert "best configuration: mtp-k2" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "words"), [
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "1", "--goodput", "queue=1s"], "unknown target"),
    (["--request-rate", "1", "--optimise-rate", "3"], "--optimise-rate 3"),
    (["--optimise-rate", "1"], "--optimise-rate 1"),
    (["--concurrency", "0"], "--concurrency"),
])
def test_bad_load_input_is_a_usage_error(tmp_path: Path, args: list[str], words: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    fake = LoadRunner()
    rc = sweep.main(["--methods", "baseline", "--results", str(tmp_path / "res"), "--quiet", *args],
                    runner=fake)
    err = capsys.readouterr().err
    assert rc == 2 and words in err and fake.calls == []
