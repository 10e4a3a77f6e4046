"""The report's charts use their colours as documented (docs/benchmarks.md "Where the verdict shows":
differing configurations red, marked "[outputs differ]"), drop charts with nothing to draw, and never show
a differing row's maximum as a peak (issue 46 item 13)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sparkllm.bench import report as bench_report
from sparkllm.bench import store as bench_store

from tests.unit.bench_helpers import fake_doc

pytest.importorskip("matplotlib")
from matplotlib.colors import to_rgba  # noqa: E402

RED = {to_rgba("red"), to_rgba("C3"), to_rgba("tab:red")}


def _garbled(doc: dict[str, Any]) -> dict[str, Any]:
    for q in doc["requests"]:
        q["output_text"] = "wrong " * 5
    return doc


def _store(tmp: Path, docs: list[dict[str, Any]]) -> Path:
    store = tmp / "store"
    conn = bench_store.open_store(store)
    for d in docs:
        bench_store.store_run(conn, d)
    conn.close()
    return store


def _figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every figure the report saves, by file name, captured before it is closed."""
    figs: dict[str, Any] = {}
    real = bench_report._save

    def save(fig: Any, plt: Any, path: Path) -> None:
        figs[path.name] = fig
        real(fig, plt, path)

    monkeypatch.setattr(bench_report, "_save", save)
    return figs


def test_only_a_differing_configuration_is_drawn_red(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five methods: the fourth bar took matplotlib's fourth colour, red, though its outputs were right, and
    the garbler got a cycle colour with a red hatch edge."""
    speeds = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    docs = [fake_doc("baseline", r, speeds, run_id=f"b{r}") for r in (1, 2)]
    for i, label in enumerate(["mtp-k1", "mtp-k2", "mtp-k3", "mtp-k4"]):
        docs.append(fake_doc(label, 1, [s * (1.2 + 0.1 * i) for s in speeds], run_id=f"m{i}",
                             per_position=[0.8, 0.5][: 1 + i % 2]))
    docs.append(_garbled(fake_doc("dflash-k2", 1, [s * 3 for s in speeds], run_id="g", per_position=[0.9])))
    store = _store(tmp_path, docs)
    figs = _figures(monkeypatch)
    _, stats = bench_report.make_report(store)
    assert {m.label for m in stats if m.differs} == {"dflash-k2"}
    ax = figs["speedup_by_category.png"].axes[0]
    colours = {}
    for container in ax.containers:
        colours[container.get_label()] = {to_rgba(p.get_facecolor()) for p in container.patches}
    assert set(colours) == {"mtp-k1", "mtp-k2", "mtp-k3", "mtp-k4", "dflash-k2 [outputs differ]"}
    for label, faces in colours.items():
        assert (faces <= RED) == ("differ" in label), (label, faces)
    lines = figs["acceptance_by_position.png"].axes[0].get_lines()
    for line in lines:
        assert (to_rgba(line.get_color()) in RED) == ("differ" in line.get_label()), line.get_label()


def test_charts_with_nothing_to_draw_are_dropped_with_their_links(tmp_path: Path) -> None:
    """No baseline run: every speedup is unknown, so the speedup chart is empty; no drafter: no acceptance
    by position. Neither is written nor linked."""
    store = _store(tmp_path, [fake_doc("mtp-k2", 1, [10.0, 12.0], run_id="m")])
    path, _ = bench_report.make_report(store)
    md = path.read_text()
    assert "decode_tok_s.png" in md and (path.parent / "decode_tok_s.png").exists()
    for empty in ("speedup_by_category.png", "acceptance_by_position.png"):
        assert empty not in md and not (path.parent / empty).exists()


def test_a_differing_rows_maximum_is_not_shown_as_a_peak(tmp_path: Path) -> None:
    """A garbler's "max" 764.5 tok/s was an artefact of a server answering 393.75 for every request."""
    speeds = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    docs = [fake_doc("baseline", r, speeds, run_id=f"b{r}") for r in (1, 2)]
    docs.append(_garbled(fake_doc("dflash-k2", 1, [393.75] * 5 + [764.5], run_id="g")))
    path, stats = bench_report.make_report(_store(tmp_path, docs), charts=False)
    assert {m.label for m in stats if m.differs} == {"dflash-k2"}
    row = next(ln for ln in path.read_text().splitlines() if ln.startswith("| dflash-k2 |"))
    assert "764.50" not in row and "outputs differ: no peak" in row, row
    base = next(ln for ln in path.read_text().splitlines() if ln.startswith("| baseline |"))
    assert "15.00" in base  # a right row keeps its peak
