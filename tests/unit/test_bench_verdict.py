"""Issue 30: a verdict with a stated error rate; nothing unchecked recommended as checked; the verdict in
the CSV and every chart; a store that is not one refused."""

from __future__ import annotations

import csv
import sqlite3
from pathlib import Path
from typing import Any

import bench
import pytest
import sweep
from sparkllm.bench import analysis as bench_analysis
from sparkllm.bench import prompts as bench_prompts
from sparkllm.bench import report as bench_report
from sparkllm.bench import stats as bench_stats
from sparkllm.bench import store as bench_store
from sparkllm.bench.common import DEFAULT_PROMPTS

from tests.unit.bench_helpers import fake_doc
from tests.unit.test_sweep import FakeRunner


def _doc(label: str, rep: int, speed: float, *, wrong: tuple[int, ...] = (), conc: int = 1,
         per_position: list[float] | None = None, meta: dict[str, Any] | None = None,
         n: int = 30) -> dict[str, Any]:
    """A run of n prompts answering like every other label, except the prompts in ``wrong`` (their text
    departs from the 6th character on)."""
    d = fake_doc(label, rep, [speed] * n, per_position=per_position, run_id=f"{label}-c{conc}-r{rep}",
                 started=f"2026-01-01T00:{conc}{rep}:00.000000Z")
    d["meta"].update(concurrency=conc, **(meta or {}))
    for i in wrong:
        q = d["requests"][i]
        q["output_text"] = q["output_text"][:5] + " garbled words"
    return d


def _store(tmp: Path, docs: list[dict[str, Any]]) -> Path:
    store = tmp / "store"
    conn = bench_store.open_store(store)
    try:
        for d in docs:
            bench_store.store_run(conn, d)
    finally:
        conn.close()
    return store


def _rows(store: Path, baseline: str = "baseline") -> tuple[str, dict[str, Any], list[Any]]:
    path, stats = bench_report.make_report(store, charts=False, baseline=baseline)
    return path.read_text(), {m.label: m for m in stats}, stats


def _recommendation(md: str) -> list[str]:
    rec = md.split("## Recommendation")[1].split("\n## ")[0]
    return [ln for ln in rec.splitlines() if ln.startswith("- **")]


def test_the_exact_test_and_its_stated_rates() -> None:
    # Binomial(30, 0.01): P(X >= 3) = 1 - (P0 + P1 + P2), by hand 0.003318
    assert bench_stats.binom_tail(30, 0.01, 3) == pytest.approx(0.0033177, rel=1e-4)
    assert bench_stats.binom_tail(30, 0.01, 0) == 1.0 and bench_stats.binom_tail(30, 0.01, 31) == 0.0
    assert bench_stats.critical_count(30, 0.01) == 3  # 3 of 30 differing prompts say "differ" at floor 1.00
    assert bench_stats.critical_count(30, 0.1) == 8  # at a floor of 0.90: 8 of 30
    # at the allowance the false alarm is at most alpha, exactly
    c = bench_stats.critical_count(80, 0.01)
    tail = bench_stats.binom_tail
    assert tail(80, 0.01, c) <= bench_stats.VERDICT_ALPHA < tail(80, 0.01, c - 1)
    assert bench_stats.miss_rate(30, 0.15) == pytest.approx(0.125, abs=0.005)
    need = bench_stats.prompts_needed(0.10)
    assert need == 69 and bench_stats.miss_rate(need, 0.10) <= 0.05 < bench_stats.miss_rate(need - 1, 0.10)
    assert bench_stats.prompts_needed(0.10, floor_mismatch=0.1) > need  # a lower floor needs more prompts
    # the default prompt set is large enough to detect a 10 % error share
    assert len(bench_prompts.load_prompts(DEFAULT_PROMPTS, None)[0]) >= need


@pytest.mark.parametrize("wrong", [(0, 7, 14, 21), (0, 6, 12, 18, 24)])
def test_a_15_percent_garbler_over_30_prompts_is_flagged_and_never_recommended(tmp_path: Path, wrong) -> None:
    """The proxy of the issue: right on most prompts, the whole answer replaced on the others (4 or 5 of
    30, 13-17 %); faster than the lossless method, flagged, never recommended."""
    store = _store(tmp_path, [_doc("baseline", 1, 10.0), _doc("baseline", 2, 10.0),
                              _doc("mtp-k2", 1, 14.0), _doc("proxy-k2", 1, 20.0, wrong=wrong)])
    md, rows, stats = _rows(store)
    o = rows["proxy-k2"].outputs
    assert rows["proxy-k2"].differs and o["differing"] == len(wrong) and o["floor_identical_share"] == 1.0
    assert o["p_value"] <= bench_stats.VERDICT_ALPHA and o["first_divergence_min"] == 5
    assert not rows["mtp-k2"].differs and rows["mtp-k2"].outputs["differing"] == 0
    assert bench_analysis.best_row(stats, 1).label == "mtp-k2"
    assert _recommendation(md)[0].startswith("- **Single stream**: `mtp-k2`")
    assert "Not recommended whatever their speed (outputs differ from baseline): `proxy-k2`" in md
    outputs = md.split("## Outputs vs baseline")[1]
    assert "| proxy-k2 | baseline | 30 | " + str(len(wrong)) + " |" in outputs and "| 5 / 5 |" in outputs
    assert "69 prompts for 10%" in outputs  # what the test can see, stated beside it


def test_a_lossless_method_at_floor_one_is_not_flagged(tmp_path: Path) -> None:
    store = _store(tmp_path, [_doc("baseline", 1, 10.0), _doc("baseline", 2, 10.0), _doc("mtp-k2", 1, 14.0),
                              _doc("mtp-k2", 2, 14.0)])
    md, rows, _ = _rows(store)
    o = rows["mtp-k2"].outputs
    assert not o["differs"] and o["floor_identical_share"] == 1.0 and o["p_value"] == 1.0
    assert "outputs same as `baseline` on 30/30 prompts" in _recommendation(md)[0]


def test_a_lossless_method_at_floor_0_9_is_not_flagged_and_the_same_count_at_floor_one_is(
        tmp_path: Path) -> None:
    """Batch numerics: two baseline runs disagree on 3 of 30 prompts (floor 0.90); a method that disagrees
    on 3 others is at the floor. The same 3 of 30 against baselines that always agree is not."""
    method = _doc("mtp-k2", 1, 14.0, wrong=(10, 11, 12))
    store = _store(tmp_path / "noisy", [_doc("baseline", 1, 10.0), _doc("baseline", 2, 10.0, wrong=(0, 1, 2)),
                                        method])
    _, rows, _ = _rows(store)
    o = rows["mtp-k2"].outputs
    assert o["floor_identical_share"] == pytest.approx(0.9) and o["identical_share"] == pytest.approx(0.9)
    assert not o["differs"] and o["p_value"] > 0.5
    exact = _store(tmp_path / "exact", [_doc("baseline", 1, 10.0), _doc("baseline", 2, 10.0), method])
    _, rows, _ = _rows(exact)
    assert rows["mtp-k2"].differs and rows["mtp-k2"].outputs["floor_identical_share"] == 1.0


def test_with_no_baseline_every_recommendation_says_outputs_not_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A first `make deploy SPEC_METHOD=mtp` labels its runs mtp-k2: nothing to compare with."""
    docs = [_doc("mtp-k2", 1, 14.0, conc=c) for c in (1, 2)]
    docs += [_doc("garbler", 1, 20.0, conc=c, wrong=tuple(range(30))) for c in (1, 2)]
    store = _store(tmp_path, docs)
    md, rows, stats = _rows(store)
    rec = _recommendation(md)
    assert len(rec) == 2 and all("**outputs not checked**" in ln for ln in rec)
    assert "make deploy SPEC_METHOD=baseline" in md.split("## Recommendation")[1].split("\n## ")[0]
    assert all(bench_analysis.verdict_word(m, "baseline") == "not checked" for m in stats)
    assert bench_analysis.best_row(stats, 1, checked_only="baseline") is None
    capsys.readouterr()
    assert bench.main(["report", str(store), "--no-charts"]) == 0
    out = capsys.readouterr().out.splitlines()
    said = [ln for ln in out if ln.startswith("outputs of ")]
    assert len(said) == 4
    assert all("NOT CHECKED" in ln and "make deploy SPEC_METHOD=baseline" in ln for ln in said)


def test_report_with_a_baseline_label_that_is_not_there_checks_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path, [_doc("baseline", 1, 10.0), _doc("garbler", 1, 20.0, wrong=tuple(range(30)))])
    md, rows, _ = _rows(store, baseline="nosuch")
    rec = _recommendation(md)
    assert rec and all("outputs not checked" in ln for ln in rec)
    assert rows["garbler"].outputs is None


def test_a_single_method_deploy_is_checked_against_an_earlier_baseline_of_its_checkpoint(
        tmp_path: Path) -> None:
    """The baseline was recorded earlier on this Spark at concurrency 1 only; the deploy measures 1 and 2:
    both rows are checked against it (the one at 2 'at another load'). A baseline of another checkpoint,
    or of another host, checks nothing."""
    spark = {"host": "spark-1", "model_manifest_sha256": "aa11"}
    base = [_doc("baseline", r, 10.0, meta=spark) for r in (1, 2)]
    deploy = [_doc("mtp-k2", 0, 14.0, conc=c, meta=spark) for c in (1, 2)]
    md, rows, _ = _rows(_store(tmp_path / "same", base + deploy))
    one, two = rows["mtp-k2 c=1"].outputs, rows["mtp-k2 c=2"].outputs
    assert one["same_context"] and not two["same_context"]
    assert one["baseline_row"] == two["baseline_row"] == "baseline c=1" and not two["differs"]
    assert "outputs same as `baseline c=1` at another load" in _recommendation(md)[1]
    for n, other in enumerate(({"model_manifest_sha256": "bb22"}, {"host": "spark-2"})):
        elsewhere = [_doc("baseline", r, 10.0, meta={**spark, **other}) for r in (1, 2)]
        _, rows, _ = _rows(_store(tmp_path / f"other{n}", elsewhere + deploy))
        assert rows["mtp-k2 c=1"].outputs is None and rows["mtp-k2 c=2"].outputs is None


def test_csv_carries_the_verdict_k_and_per_position_acceptance(tmp_path: Path) -> None:
    docs = [_doc("baseline", 1, 10.0), _doc("mtp-k2", 1, 14.0, per_position=[0.8, 0.4]),
            _doc("proxy-k2", 1, 20.0, wrong=(0, 7, 14, 21, 28), per_position=[0.9, 0.5]),
            _doc("ngram", 1, 11.0, meta={"model_manifest_sha256": "other"})]
    docs[1]["spec"]["num_speculative_tokens"] = docs[2]["spec"]["num_speculative_tokens"] = 2
    bad = fake_doc("mtp-k2", 2, [1.0] * 30, valid=False, run_id="invalid-run")
    store = _store(tmp_path, [*docs, bad])
    assert bench.main(["export", str(store), "--csv", "--out", str(tmp_path / "csv")]) == 0
    runs = {r["run_id"]: r for r in csv.DictReader((tmp_path / "csv" / "runs.csv").open())}
    got = {k: (r["verdict"], r["k"], r["per_position_acceptance"]) for k, r in runs.items()}
    assert got == {"baseline-c1-r1": ("reference", "", ""), "mtp-k2-c1-r1": ("same", "2", "0.800/0.400"),
                   "proxy-k2-c1-r1": ("differs", "2", "0.900/0.500"), "ngram-c1-r1": ("not checked", "", ""),
                   "invalid-run": ("invalid", "", "")}


class _Charts:
    """Collects the figures render_charts saves, to look at them instead of the PNGs."""

    def __init__(self) -> None:
        self.figs: dict[str, Any] = {}

    def __call__(self, fig: Any, plt: Any, path: Path) -> None:
        fig.canvas.draw()
        self.figs[path.name] = fig


def test_charts_mark_differing_methods_use_whole_positions_and_legends_beside_the_axes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    docs = []
    for c in (1, 2):
        docs += [_doc("baseline", r, 10.0, conc=c) for r in (1, 2)]
        docs += [_doc("mtp-k2", 1, 14.0, conc=c, per_position=[0.8, 0.4]),
                 _doc("proxy-k2", 1, 20.0, conc=c, per_position=[0.9, 0.6], wrong=(0, 7, 14, 21, 28))]
    store = _store(tmp_path, docs)
    stats = bench_report.method_table(bench_report.load_runs(store), "baseline")
    bench_analysis.output_checks(stats, "baseline", bench_report.pair_runs)
    charts = _Charts()
    monkeypatch.setattr(bench_report, "_save", charts)
    names = bench_report.render_charts(stats, "baseline", tmp_path)
    assert set(names) == set(charts.figs) >= {"decode_tok_s.png", "acceptance_by_position.png",
                                               "speedup_by_category.png", "tok_s_vs_concurrency.png"}
    mark = "[outputs differ]"
    ticks = [t.get_text() for t in charts.figs["decode_tok_s.png"].axes[0].get_xticklabels()]
    assert sum(mark in t for t in ticks) == 2 and sum("proxy-k2" in t for t in ticks) == 2
    for name in names:
        ax = charts.figs[name].axes[0]
        leg = ax.get_legend()
        if name == "decode_tok_s.png":
            continue
        texts = [t.get_text() for t in leg.get_texts()]
        assert any(mark in t for t in texts), (name, texts)
        # the legend sits right of the axes: it covers no bar, line or point
        assert leg.get_window_extent().x0 >= ax.get_window_extent().x1, name
    acc = charts.figs["acceptance_by_position.png"].axes[0]
    assert list(acc.get_xticks()) == [1, 2]  # whole draft positions only
    assert len(acc.get_legend().get_texts()) == 2  # one line per configuration, not one per row


# a 0-byte file is no longer refused: it is what a writer leaves the moment it opens a new store, so a store
# being created (test_bench_store_safety.py, issue 46 item 5)
@pytest.mark.parametrize("content", [b"not a database at all, just text\n", "other-schema"])
def test_a_store_that_is_not_a_results_store_is_refused_untouched(
        tmp_path: Path, content: bytes | str, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "res"
    store.mkdir()
    db = store / bench_store.STORE_NAME
    if content == "other-schema":
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, path TEXT)")
        conn.close()
    else:
        db.write_bytes(content)
    before = db.read_bytes()
    for argv in (["report", str(store), "--no-charts"], ["export", str(store), "--csv"],
                 ["lookup", "--store", str(store), "--config-hash", "x", "--repetition", "1"]):
        capsys.readouterr()
        assert bench.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "not a results store" in err or "not an SQLite database" in err
        assert "bench.py import" in err  # the fix
        assert db.read_bytes() == before
    assert not (store / "report").exists() and not (store / "export").exists()


def test_leave_best_refuses_to_choose_among_unchecked_methods(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--methods", "ngram,mtp", "--mtp-k", "2", "--repeats", "1", "--results", str(tmp_path / "res"),
            "--quiet", "--leave-best"]
    fake = FakeRunner()
    assert sweep.main(args, runner=fake) == 1
    assert all("bench" in c.tags for c in fake.calls)  # nothing left serving
    io = capsys.readouterr()
    assert "--leave-best refused" in io.err and "--allow-unchecked" in io.err
    assert "outputs not checked" in io.out and "mtp-k2" in io.out
    fake = FakeRunner()
    assert sweep.main([*args, "--allow-unchecked"], runner=fake) == 0
    assert fake.calls[-1].tags == "cluster,serve" and fake.calls[-1].extravars["bench_label"] == "mtp-k2"
    assert "OUTPUTS NOT CHECKED" in capsys.readouterr().out


def test_leave_best_chooses_among_checked_methods_only(tmp_path: Path) -> None:
    """A baseline in the sweep: mtp-k2 is checked and chosen."""
    fake = FakeRunner()
    rc = sweep.main(["--methods", "baseline,mtp", "--mtp-k", "2", "--repeats", "1", "--results",
                     str(tmp_path / "res"), "--quiet", "--leave-best"], runner=fake)
    assert rc == 0 and fake.calls[-1].tags == "cluster,serve"
    assert fake.calls[-1].extravars["bench_label"] == "mtp-k2"
