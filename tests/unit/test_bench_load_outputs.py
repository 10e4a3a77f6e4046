"""Issue 23 figures against the stand-in's known behaviour: load, outputs, depth, telemetry, store v2."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import bench
import pytest
from sparkllm.bench import analysis as bench_analysis
from sparkllm.bench import depth as bench_depth
from sparkllm.bench import report as bench_report
from sparkllm.bench import store as bench_store
from sparkllm.bench import telemetry as bench_telemetry

from tests.fixtures.standin_server import Config, StandinServer
from tests.unit.bench_helpers import run_against, write_prompts


def _docs(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def test_concurrency_list_one_run_per_level_and_known_slowdown(tmp_path: Path) -> None:
    """Stand-in law: a step lasts step_time * (1 + 0.5 * (running - 1)); at 2 streams 1.5x slower."""
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=2)
    cfg = Config(model="m", step_time=0.01, concurrency_slowdown=0.5)
    with StandinServer(cfg) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "baseline",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--max-tokens", "21",
                         "--warmup", "0", "--quiet", "--concurrency", "1,2"])
    assert rc == 0
    docs = {d["meta"]["concurrency"]: d for d in _docs(tmp_path / "out")}
    assert set(docs) == {1, 2} and all(d["valid"] for d in docs.values())
    one, two = (docs[c]["summary"]["decode_tok_s"]["median"] for c in (1, 2))
    assert one == pytest.approx(100.0, rel=0.15) and one / two == pytest.approx(1.5, rel=0.15)
    # aggregate grows with the streams: 2 streams at 1/1.5 of the rate each -> about 4/3 of one stream
    agg1, agg2 = (docs[c]["summary"]["token_weighted"]["output_tok_s_wall"] for c in (1, 2))
    assert agg2 / agg1 == pytest.approx(4 / 3, rel=0.2)
    stats = bench_report.method_table(bench_report.load_runs(tmp_path / "out"), "baseline")
    assert [m.label for m in stats] == ["baseline c=1", "baseline c=2"]


def test_a_depth_beyond_the_served_maximum_is_a_usage_error_before_any_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM lists max_model_len in /v1/models: a depth whose prompt plus --max-tokens cannot fit is refused
    (exit 2, naming the largest depth that fits) before a single request is sent."""
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=1)
    with StandinServer(Config(model="m", max_model_len=2048)) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "deep",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--max-tokens", "100",
                         "--warmup", "0", "--quiet", "--depth", "512,2000"])
        served = srv.engine.c.success
    err = capsys.readouterr().err
    assert rc == 2 and "--depth 2000" in err and "served maximum of 2048" in err and "up to 1948" in err
    assert served == 0 and not list((tmp_path / "out").glob("*.json"))


@pytest.mark.parametrize("bad", ["0", "1,x", "2,2"])
def test_bad_concurrency_list_is_a_usage_error(tmp_path: Path, bad: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench.main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x",
                     "--out", str(tmp_path / "o"), "--concurrency", bad])
    assert rc == 2 and "--concurrency" in capsys.readouterr().err


def _store(tmp: Path, runs: list[tuple[str, Config, int]], n_per_cat: int = 2) -> Path:
    store = tmp / "store"
    for i, (label, cfg, rep) in enumerate(runs):
        (tmp / f"r{i}").mkdir()
        doc, _ = run_against(cfg, tmp / f"r{i}", label=label, max_tokens=12, n_per_cat=n_per_cat,
                             meta={"repetition": rep, "method": label.split("-")[0]})
        conn = bench_store.open_store(store)
        bench_store.store_run(conn, doc)
        conn.close()
    return store


def test_a_configuration_garbled_only_under_load_is_out_at_every_level(tmp_path: Path) -> None:
    """Right alone, wrong when batched (the GB10 spec-decode + CUDA-graph failure): its single-stream rows
    match the baseline, yet it must not be recommended (nor left serving) at any level."""
    base = Config(model="m", step_time=0.01)
    good = Config(model="m", step_time=0.01, spec=True, method="mtp", k=2, pattern=(1,))
    bad = Config(model="m", step_time=0.003, spec=True, method="dflash", k=2, pattern=(2,),
                 garble_under_load=True)
    store = tmp_path / "store"
    plan = [("baseline", base, 1, 1), ("baseline", base, 1, 2), ("baseline", base, 2, 1),
            ("mtp-k2", good, 1, 1), ("mtp-k2", good, 2, 1),
            ("dflash-k2", bad, 1, 1), ("dflash-k2", bad, 2, 1)]
    for i, (label, cfg, conc, rep) in enumerate(plan):
        (tmp_path / f"r{i}").mkdir()
        doc, _ = run_against(cfg, tmp_path / f"r{i}", label=label, max_tokens=12, concurrency=conc,
                             meta={"repetition": rep, "method": label.split("-")[0], "concurrency": conc})
        conn = bench_store.open_store(store)
        bench_store.store_run(conn, doc)
        conn.close()
    path, stats = bench_report.make_report(store, charts=False)
    rows = {m.label: m for m in stats}
    one, two = rows["dflash-k2 c=1"], rows["dflash-k2 c=2"]
    assert not one.differs and one.outputs["identical_share"] == 1.0  # alone it is right...
    assert two.differs  # ...batched it is not
    assert one.decode["median"] > rows["mtp-k2 c=1"].decode["median"]  # and it is the fastest alone
    assert bench_analysis.best_row(stats, 1).label == "mtp-k2 c=1"
    assert bench_analysis.best_row(stats, 2).label == "mtp-k2 c=2"
    rec = path.read_text().split("## Recommendation")[1].split("\n## ")[0]
    assert "**Single stream**: `mtp-k2 c=1`" in rec
    assert "outputs differ" in rec and "`dflash-k2`" in rec


def test_a_noise_floor_below_one_keeps_a_method_at_the_floor_and_flags_one_below_it(tmp_path: Path) -> None:
    """Batch numerics on a real GPU: two baseline runs do not agree on every prompt. The stand-in leaves the
    greedy text on 40 % of prompts per server (which ones: its noise seed). A method with the same numerics
    sits at the floor and is kept; one that garbles every prompt falls below it and is flagged (30 prompts:
    with 4, the exact test cannot tell all-wrong from a floor this low, docs/benchmarks.md)."""
    def cfg(noise_seed: int, **kw) -> Config:
        return Config(model="m", **{"step_time": 0.01, **kw}, numeric_noise=0.4, noise_seed=noise_seed)

    store = _store(tmp_path, [("baseline", cfg(1), 1), ("baseline", cfg(2), 2),
                              ("mtp-k2", cfg(3, spec=True, method="mtp", k=2, pattern=(1,)), 1),
                              ("dflash-k2", cfg(4, step_time=0.003, spec=True, method="dflash", k=2,
                                                pattern=(2,), garble=True), 1)], n_per_cat=15)
    _, stats = bench_report.make_report(store, charts=False)
    rows = {m.label: m for m in stats}
    mtp, dflash = rows["mtp-k2"].outputs, rows["dflash-k2"].outputs
    floor = mtp["floor_identical_share"]
    assert 0.1 < floor < 0.9  # the two baselines disagree on some prompts, agree on others
    assert not mtp["differs"] and abs(mtp["identical_share"] - floor) <= 0.3  # at the floor: kept
    assert dflash["differs"] and dflash["identical_share"] == 0.0  # below it: flagged
    assert bench_analysis.best_row(stats, 1).label == "mtp-k2"


def _rows(stats: list, store: Path, *labels: str) -> dict:
    """The report's rows by label; a missing one fails naming why its runs were left out (their problems)."""
    rows = {m.label: m for m in stats}
    missing = [x for x in labels if x not in rows]
    if missing:
        left_out = {r.run_id: r.problems for r in bench_report.load_runs(store) if not r.valid}
        raise AssertionError(f"rows {missing} missing from the report; invalid runs left out: {left_out}")
    return rows


def test_fast_garbled_method_is_flagged_and_never_best(tmp_path: Path) -> None:
    base = Config(model="m", step_time=0.01)
    good = Config(model="m", step_time=0.01, spec=True, method="mtp", k=2, pattern=(1,))
    garbled = Config(model="m", step_time=0.003, spec=True, method="dflash", k=2, pattern=(2,), garble=True)
    store = _store(tmp_path, [("baseline", base, 1), ("mtp-k2", good, 1), ("dflash-k2", garbled, 1),
                              ("baseline", base, 2)])
    db = sqlite3.connect(store / "results.sqlite")
    docs = [json.loads(r[0]) for r in db.execute("SELECT doc FROM runs")]
    assert all(len(q["output_sha256"]) == 64 and q["output_text"] for d in docs for q in d["requests"])
    path, stats = bench_report.make_report(store, charts=False)
    rows = _rows(stats, store, "baseline", "mtp-k2", "dflash-k2")
    assert rows["dflash-k2"].decode["median"] > rows["mtp-k2"].decode["median"]  # fastest...
    assert rows["dflash-k2"].differs and not rows["mtp-k2"].differs  # ...but garbled
    assert rows["mtp-k2"].outputs["identical_share"] == 1.0
    assert rows["mtp-k2"].outputs["floor_identical_share"] == 1.0  # two baseline runs agree
    assert rows["dflash-k2"].outputs["median_prefix_share"] < 0.5
    assert bench_analysis.best_row(stats, 1).label == "mtp-k2"
    md = path.read_text()
    rec = md.split("## Recommendation")[1].split("##")[0]
    assert "**Single stream**: `mtp-k2`" in rec and "`dflash-k2`" in rec and "outputs differ" in rec
    assert bench.main(["export", str(store), "--csv", "--out", str(tmp_path / "csv")]) == 0
    import csv
    runs_csv = list(csv.DictReader((tmp_path / "csv" / "runs.csv").open()))
    reqs_csv = list(csv.DictReader((tmp_path / "csv" / "requests.csv").open()))
    assert len(runs_csv) == 4 and len(reqs_csv) == sum(len(d["requests"]) for d in docs)
    assert all(len(r["output_sha256"]) == 64 for r in reqs_csv)
    checks = dict(sqlite3.connect(store / "results.sqlite").execute(
        "SELECT r.label, c.differs FROM output_checks c JOIN runs r USING (run_id)").fetchall())
    assert checks == {"mtp-k2": 0, "dflash-k2": 1}


def test_depth_calibrated_and_prefill_cost_known(tmp_path: Path) -> None:
    """tokens_per_word 1.3 (the calibration must find the words), prefill 0.1 ms per prompt token."""
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=1)
    cfg = Config(model="m", step_time=0.005, tokens_per_word=1.7, prefill_per_token=1e-4, prefill_time=0.0)
    with StandinServer(cfg) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "baseline",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--max-tokens", "8",
                         "--warmup", "0", "--quiet", "--depth", "2000"])
        served = [t.prompt_tokens for t in srv.truth]
    assert rc == 0
    (doc,) = _docs(tmp_path / "out")
    d = doc["meta"]["depth"]
    assert d["target_tokens"] == 2000 and abs(d["calibrated_prompt_tokens"] - 2000) <= 100
    assert d["outside_tolerance"] == 0 and d["filler_sha256"] == bench_depth.FILLER_SHA256
    assert all(abs(p - 2000) <= 100 for p in served[-2:])
    ttft = doc["summary"]["ttft_s"]["median"]
    pt = doc["summary"]["prompt_tokens"]["median"]
    assert ttft == pytest.approx(pt * 1e-4, rel=0.25)
    assert doc["summary"]["prefill_tok_s"]["median"] == pytest.approx(1e4, rel=0.25)
    md = bench_report.make_report(tmp_path / "out", charts=False)[0].read_text()
    assert "## Context depth" in md


def test_filler_is_pinned_by_hash() -> None:
    assert bench_depth.corpus_sha256() == bench_depth.FILLER_SHA256


def _fake_smi(tmp: Path, lines: list[str]) -> str:
    """An nvidia-smi printing the next line of a trace on every call (the last one repeated)."""
    trace = tmp / "trace.txt"
    trace.write_text("\n".join(lines) + "\n")
    exe = tmp / "nvidia-smi"
    exe.write_text(f"""#!/bin/sh
n=$(cat {tmp}/n 2>/dev/null || echo 1)
sed -n "${{n}}p" {trace} | grep . || tail -n 1 {trace}
echo $((n + 1)) > {tmp}/n
""")
    exe.chmod(0o755)
    return str(exe)


def test_energy_per_token_from_a_known_power_trace(tmp_path: Path) -> None:
    smi = _fake_smi(tmp_path, ["100.0, 60, 2000"])
    tel = bench_telemetry.Telemetry(0.05, smi)
    tel.start()
    import time
    time.sleep(0.3)
    tel.stop()
    s = tel.summary(output_tokens=50)
    span = s["samples"][-1]["t_s"] - s["samples"][0]["t_s"]
    assert s["energy_j"] == pytest.approx(100.0 * span) and s["j_per_output_token"] == pytest.approx(2 * span)
    assert s["warnings"] == [] and s["power_w_mean"] == 100.0


def test_throttle_marks_a_warning_not_an_invalid_run(tmp_path: Path) -> None:
    samples = [{"t_s": 0.0, "power_w": 50.0, "temp_c": 70.0, "sm_clock_mhz": 2400.0},
               {"t_s": 2.0, "power_w": 150.0, "temp_c": 90.0, "sm_clock_mhz": 1500.0}]
    s = bench_telemetry.summarise(samples, 100, True)
    assert s["energy_j"] == pytest.approx(200.0) and s["j_per_output_token"] == pytest.approx(2.0)
    assert len(s["warnings"]) == 2
    smi = _fake_smi(tmp_path, ["120.0, 90, 2400", "120.0, 90, 1200"])
    doc, _ = run_against(Config(model="m"), tmp_path, max_tokens=8)
    assert doc["valid"]  # the helper's run used PATH; now one with the throttling trace:
    from sparkllm.bench import client as bench_client
    from sparkllm.bench import runner as bench_runner
    with StandinServer(Config(model="m")) as srv:
        opts = bench_runner.RunOptions(base_url=srv.base_url, model="m", label="x", out=tmp_path / "o2",
                                       prompts=tmp_path / "p.jsonl", warmup=0, progress=False,
                                       sampling=bench_client.Sampling(max_tokens=8), nvidia_smi=smi,
                                       telemetry_interval=0.02)
        hot = bench_runner.execute_run(opts)
    assert hot["valid"] and any("dropped" in w for w in hot["warnings"])
    assert any("temperature" in w for w in hot["warnings"])


def test_host_without_nvidia_smi_says_so(tmp_path: Path) -> None:
    s = bench_telemetry.summarise([{"t_s": 0.0, "mem_available_mib": 1.0}], 10, False)
    assert s["j_per_output_token"] is None and "no nvidia-smi" in s["note"]


def test_version_1_store_is_migrated(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / bench_store.STORE_NAME)
    conn.executescript(bench_store.MIGRATIONS[0][2])
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO runs (run_id, label, valid, problems, doc) "
                 "VALUES ('old', 'baseline', 1, '[]', '{}')")
    conn.commit()
    conn.close()
    conn = bench_store.open_store(tmp_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == bench_store.SCHEMA_VERSION
    assert [tuple(r) for r in conn.execute("SELECT run_id, input_depth FROM runs")] == [("old", None)]
    cols = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
    assert {"output_sha256", "output_text", "prompt_tokens"} <= cols


def _own_text(path: Path, words: int) -> Path:
    """An owner's text: numbered words, so a window's position and any repetition can be read back."""
    path.write_text("\n".join(" ".join(f"w{i}" for i in range(j, min(j + 12, words)))
                              for j in range(0, words, 12)) + "\n", encoding="utf-8")
    return path


def test_depth_text_is_the_owners_own_never_repeated_and_recorded(tmp_path: Path) -> None:
    """--depth-text: the depth is built from the owner's words (each prompt its own window, no word twice),
    the run records the text by sha256 and name, and the report keeps it apart from generated depth runs."""
    import hashlib

    text = _own_text(tmp_path / "notes.txt", 6000)
    fill = bench_depth.load_filler(text)
    assert fill.source == "notes.txt" and fill.sha256 == hashlib.sha256(text.read_bytes()).hexdigest()
    for window in (0, 1, 3, 5):  # window 3 would wrap around the end of the text if it were allowed to
        body = bench_depth.filler(1500, window, fill).split()
        first = int(body[0][1:])
        assert body == [f"w{i}" for i in range(first, first + 1500)]  # one contiguous slice, never wrapped
    assert bench_depth.filler(1500, 0, fill) != bench_depth.filler(1500, 1, fill)  # own window per prompt
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=1)
    cfg = Config(model="m", step_time=0.003, tokens_per_word=1.3)
    with StandinServer(cfg) as srv:
        for label, extra in (("own", ["--depth-text", str(text)]), ("gen", [])):
            assert bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", label,
                               "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--max-tokens", "6",
                               "--warmup", "0", "--quiet", "--depth", "1000", *extra]) == 0
    docs = {d["label"]: d for d in _docs(tmp_path / "out")}
    own, gen = docs["own"]["meta"]["depth"], docs["gen"]["meta"]["depth"]
    assert own["filler_sha256"] == fill.sha256 and own["filler_source"] == "notes.txt"
    assert gen["filler_sha256"] == bench_depth.FILLER_SHA256 and gen["filler_source"] == "generated"
    assert own["outside_tolerance"] == 0 and abs(own["calibrated_prompt_tokens"] - 1000) <= 50
    md = bench_report.make_report(tmp_path / "out", charts=False)[0].read_text()
    depth_rows = md.split("## Context depth")[1].split("\n## ")[0]
    assert f"own text {fill.sha256[:12]}" in depth_rows and "| generated |" in depth_rows


def test_an_own_text_named_generated_is_still_never_repeated(tmp_path: Path) -> None:
    """Whether a filler may wrap is not read from its name: a file called "generated" is an owner's text."""
    fill = bench_depth.load_filler(_own_text(tmp_path / "generated", 600))
    assert not fill.wraps and bench_depth.generated_filler().wraps
    with pytest.raises(bench_depth.UsageError, match="too few for --depth 8192"):
        bench_depth.check_text_covers(fill, [512, 8192])
    with pytest.raises(ValueError, match="never repeated"):
        bench_depth.filler(700, 0, fill)


@pytest.mark.parametrize("case", ["short", "binary", "missing", "no-depth", "too-deep"])
def test_a_bad_depth_text_is_a_usage_error_before_any_request(tmp_path: Path, case: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    depth = "1000"
    if case == "short":
        text.write_text("only a few words here\n")
    elif case == "binary":
        text.write_bytes(b"\xff\xfe" + b"\x00\x81" * 400)
    elif case == "too-deep":
        _own_text(text, 600)  # ~0.75 words per token: 600 words cannot fill 8192 tokens
        depth = "512,8192"
    elif case != "missing":
        _own_text(text, 600)
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=1)
    with StandinServer(Config(model="m")) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "x",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--warmup", "0",
                         "--quiet", "--depth", "0" if case == "no-depth" else depth,
                         "--depth-text", str(text)])
        served = srv.engine.c.success
    err = capsys.readouterr().err
    assert rc == 2 and served == 0 and not list((tmp_path / "out").glob("*.json"))
    assert {"short": "words; a depth needs at least", "binary": "not UTF-8", "missing": "cannot read it",
            "no-depth": "add --depth", "too-deep": "too few for --depth 8192"}[case] in err


def test_a_text_the_server_counts_as_too_few_tokens_fails_without_repeating_it(tmp_path: Path) -> None:
    """Words are fewer tokens than estimated (0.3 per word): calibration needs more words than the text has,
    and the run fails (exit 1, no run written) instead of repeating the text."""
    text = _own_text(tmp_path / "t.txt", 1000)  # the up-front estimate (750 words for 1000 tokens) fits
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=1)
    with StandinServer(Config(model="m", tokens_per_word=0.3)) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "x",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--warmup", "0",
                         "--quiet", "--depth", "1000", "--depth-text", str(text)])
    assert rc == 1 and not list((tmp_path / "out").glob("*.json"))


def test_a_text_just_long_enough_is_used_whole(tmp_path: Path) -> None:
    """760 words pass the up-front estimate for 1000 tokens (750) but are fewer than calibration's first guess
    (1000 / 1.3 = 769): calibration sends the whole text instead of giving up or repeating it."""
    text = _own_text(tmp_path / "t.txt", 760)
    prompts = write_prompts(tmp_path / "p.jsonl", n_per_cat=1)
    with StandinServer(Config(model="m", step_time=0.003, tokens_per_word=1.3)) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "m", "--label", "x",
                         "--out", str(tmp_path / "out"), "--prompts", str(prompts), "--warmup", "0",
                         "--quiet", "--max-tokens", "6", "--depth", "1000", "--depth-text", str(text)])
    assert rc == 0
    (doc,) = _docs(tmp_path / "out")
    assert doc["meta"]["depth"]["words"] == 760 and doc["meta"]["depth"]["outside_tolerance"] == 0
