"""The bad-input table: every script, each bad input, run as a user runs it (a subprocess).

Each row asserts the exit code (2 usage, 1 the work failed), one clear line on stderr naming the path or
value and the fix (never a traceback), and that nothing outside the tool's own output changed (a digest
of the whole test directory, taken before and after). The playbook's rows are in
test_inventory_anywhere.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bench
import fetch_checkpoint
import gb10_exporter
import hybrid_merge
import model_job
import mtp_index_patch
import pytest
import serve_wait
import sweep
import tune
import verify_checkpoint
from sparkllm.bench import report as bench_report
from sparkllm.bench import store as bench_store
from sparkllm.checkpoint import hybrid as ck
from sparkllm.checkpoint.safetensors_io import INDEX_NAME
from sparkllm.outdir import MARKER

from tests.fixtures.make_checkpoints import GenConfig, GeneratedPair, generate
from tests.fixtures.standin_server import Config, StandinServer
from tests.unit.bench_helpers import write_prompts

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def tree(root: Path) -> dict[str, str]:
    """path -> sha256 (files), "dir" or "link -> target": the whole state of a directory tree."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = f"link -> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS), "HF_ENDPOINT": "http://127.0.0.1:9"}
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class World:
    """A test directory with inputs in place: a checkpoint pair, a foreign directory, a file."""

    root: Path
    pair: GeneratedPair
    foreign: Path  # a user's non-empty directory
    file: Path  # a user's file
    merged: Path  # an output of hybrid_merge.py
    prompts: Path


@pytest.fixture(scope="module")
def world_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("world")
    generate(root / "src", GenConfig(layers=2, experts=2))
    return root


@pytest.fixture
def world(world_template: Path, tmp_path: Path) -> World:
    root = tmp_path / "w"
    shutil.copytree(world_template, root, symlinks=True)
    pair = GeneratedPair(int4_dir=root / "src" / "int4", fp8_dir=root / "src" / "fp8")
    foreign = root / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("my notes")
    file = root / "a-file"
    file.write_text("my file")
    merged = root / "merged"
    assert hybrid_merge.main(["--int4", str(pair.int4_dir), "--fp8", str(pair.fp8_dir),
                              "--out", str(merged)]) == 0
    prompts = write_prompts(root / "p.jsonl")
    return World(root, pair, foreign, file, merged, prompts)


@dataclass
class Row:
    name: str
    script: str
    args: Callable[[World], list[str]]
    rc: int
    needle: Callable[[World], str]
    # paths (relative to the world) the tool may change: its own output
    own: tuple[str, ...] = ()


def merge_args(out: Callable[[World], Path],
               int4: Callable[[World], Path] = lambda w: w.pair.int4_dir) -> Callable[[World], list[str]]:
    return lambda w: ["--int4", str(int4(w)), "--fp8", str(w.pair.fp8_dir), "--out", str(out(w))]


ROWS = [
    # hybrid_merge.py
    Row("merge: --out a foreign non-empty directory", "hybrid_merge.py", merge_args(lambda w: w.foreign), 2,
        lambda w: f"{w.foreign}: --out is a non-empty directory that was not created by hybrid_merge"),
    Row("merge: --out equal to --int4", "hybrid_merge.py", merge_args(lambda w: w.pair.int4_dir), 2,
        lambda w: "--out is the input --int4 itself"),
    Row("merge: --out inside --fp8", "hybrid_merge.py", merge_args(lambda w: w.pair.fp8_dir / "out"), 2,
        lambda w: "--out is inside the input --fp8"),
    Row("merge: --out holding the inputs", "hybrid_merge.py", merge_args(lambda w: w.root / "src"), 2,
        lambda w: "--out contains the input --int4"),
    Row("merge: --out an existing file", "hybrid_merge.py", merge_args(lambda w: w.file), 2,
        lambda w: f"{w.file}: --out exists and is not a directory"),
    Row("merge: --out made by another tool", "hybrid_merge.py",
        merge_args(lambda w: w.root / "fetched"), 2, lambda w: "was created by fetch_checkpoint"),
    Row("merge: --int4 missing", "hybrid_merge.py",
        lambda w: ["--int4", str(w.root / "nope"), "--fp8", str(w.pair.fp8_dir), "--out", str(w.root / "o")],
        2, lambda w: "--int4 directory does not exist"),
    Row("merge: --int4 missing a shard its index names", "hybrid_merge.py",
        merge_args(lambda w: w.root / "o", int4=lambda w: w.root / "int4-short"), 1,
        lambda w: f"{w.root / 'int4-short' / INDEX_NAME}: names 1 shard(s) missing"),
    # fetch_checkpoint.py
    Row("fetch mirror: --dest a foreign non-empty directory", "fetch_checkpoint.py",
        lambda w: ["mirror", "--src", str(w.merged), "--dest", str(w.foreign)], 2,
        lambda w: f"{w.foreign}: --dest is a non-empty directory that was not created by fetch_checkpoint"),
    Row("fetch mirror: --dest equal to --src", "fetch_checkpoint.py",
        lambda w: ["mirror", "--src", str(w.merged), "--dest", str(w.merged)], 2,
        lambda w: "--dest is the input --src itself"),
    Row("fetch mirror: --dest an existing file", "fetch_checkpoint.py",
        lambda w: ["mirror", "--src", str(w.merged), "--dest", str(w.file)], 2,
        lambda w: "--dest exists and is not a directory"),
    Row("fetch mirror: --src missing", "fetch_checkpoint.py",
        lambda w: ["mirror", "--src", str(w.root / "nope"), "--dest", str(w.root / "d")], 2,
        lambda w: "--src is not a directory"),
    Row("fetch hub: --token-file missing", "fetch_checkpoint.py",
        lambda w: ["hub", "--repo", "a/b", "--revision", "main", "--dest", str(w.root / "d"),
                   "--token-file", str(w.root / "no-token")], 2,
        lambda w: "cannot read --token-file"),
    Row("fetch hub: --dest a foreign directory (refused before any network)", "fetch_checkpoint.py",
        lambda w: ["hub", "--repo", "a/b", "--revision", "main", "--dest", str(w.foreign)], 2,
        lambda w: "not created by fetch_checkpoint"),
    Row("fetch fp8-extract: --dest is a directory", "fetch_checkpoint.py",
        lambda w: ["fp8-extract", "--repo", "a/b", "--revision", "main", "--dest", str(w.foreign)], 2,
        lambda w: "--dest is a directory; fp8-extract writes one FILE"),
    Row("fetch fp8-extract: FILE in a foreign directory", "fetch_checkpoint.py",
        lambda w: ["fp8-extract", "--repo", "a/b", "--revision", "main",
                   "--dest", str(w.foreign / "x.st")], 2,
        lambda w: "--dest's directory is a non-empty directory"),
    Row("fetch manifest: DIR missing", "fetch_checkpoint.py", lambda w: ["manifest", str(w.root / "nope")], 2,
        lambda w: "not a directory"),
    # mtp_index_patch.py
    Row("mtp patch: --target equal to --source", "mtp_index_patch.py",
        lambda w: ["--source", str(w.pair.int4_dir), "--target", str(w.pair.int4_dir)], 2,
        lambda w: "target is the source checkpoint itself"),
    Row("mtp patch: --target a foreign checkpoint", "mtp_index_patch.py",
        lambda w: ["--source", str(w.pair.int4_dir), "--target", str(w.root / "plain")], 2,
        lambda w: "target was not created by this toolkit"),
    Row("mtp patch: --target missing", "mtp_index_patch.py",
        lambda w: ["--source", str(w.pair.int4_dir), "--target", str(w.root / "nope")], 2,
        lambda w: "target does not exist"),
    # verify_checkpoint.py
    Row("verify: DIR missing", "verify_checkpoint.py", lambda w: [str(w.root / "nope")], 2,
        lambda w: "not a directory"),
    Row("verify: --int4-source missing", "verify_checkpoint.py",
        lambda w: [str(w.merged), "--int4-source", str(w.root / "nope")], 2,
        lambda w: f"--int4-source {w.root / 'nope'}: not a directory"),
    # bench.py run
    Row("bench run: --base-url not a URL", "bench.py",
        lambda w: ["run", "--base-url", "not-a-url", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r")],
        2, lambda w: "--base-url 'not-a-url': scheme must be http or https"),
    Row("bench run: --base-url port out of range", "bench.py",
        lambda w: ["run", "--base-url", "http://127.0.0.1:99999", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r")], 2, lambda w: "the port is not a number in 1..65535"),
    Row("bench run: --base-url without host", "bench.py",
        lambda w: ["run", "--base-url", "http://:8000", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r")], 2, lambda w: "no host"),
    Row("bench run: --api-key-file missing", "bench.py",
        lambda w: ["run", "--base-url", "http://127.0.0.1:8000", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r"), "--api-key-file", str(w.root / "no-key")], 2,
        lambda w: f"--api-key-file {w.root / 'no-key'}: cannot read it"),
    Row("bench run: --prompts missing", "bench.py",
        lambda w: ["run", "--base-url", "http://127.0.0.1:8000", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r"), "--prompts", str(w.root / "none.jsonl")], 2,
        lambda w: "prompt file"),
    Row("bench run: --concurrency 0", "bench.py",
        lambda w: ["run", "--base-url", "http://127.0.0.1:8000", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r"), "--concurrency", "0"], 2,
        lambda w: "--concurrency '0': need distinct integers >= 1"),
    Row("bench run: --out an existing file", "bench.py",
        lambda w: ["run", "--base-url", "http://127.0.0.1:8000", "--model", "m", "--label", "x",
                   "--out", str(w.file)], 2, lambda w: "exists and is not a directory"),
    Row("bench run: --out under a file (refused before any request)", "bench.py",
        lambda w: ["run", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--label", "x",
                   "--out", str(w.file / "results"), "--prompts", str(w.prompts), "--quiet"], 2,
        lambda w: f"{w.file / 'results'}: --out cannot be made: {w.file} is not a directory"),
    Row("bench run: --concurrency with an empty item", "bench.py",
        lambda w: ["run", "--base-url", "http://127.0.0.1:8000", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r"), "--concurrency", "1,,2"], 2,
        lambda w: "--concurrency '1,,2': an empty item"),
    Row("bench run: --temperature -1", "bench.py",
        lambda w: ["run", "--base-url", "http://127.0.0.1:8000", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r"), "--temperature", "-1"], 2,
        lambda w: "--temperature -1: must be 0 (greedy) or more"),
    Row("bench run: --stall-timeout above --stall-give-up", "bench.py",
        lambda w: ["run", "--base-url", "http://127.0.0.1:8000", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r"), "--stall-timeout", "60", "--stall-give-up", "30"], 2,
        lambda w: "--stall-timeout 60 / --stall-give-up 30: need 0 < stall timeout <= give-up"),
    Row("bench run: nothing listening", "bench.py",
        lambda w: ["run", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--label", "x",
                   "--out", str(w.root / "r"), "--prompts", str(w.prompts), "--quiet"], 1,
        lambda w: "nothing answers at http://127.0.0.1:"),
    # bench.py report / import / fetch-prompts
    Row("bench report: --out a foreign directory", "bench.py",
        lambda w: ["report", str(w.root / "store"), "--out", str(w.foreign)], 2,
        lambda w: "not created by bench.py report"),
    Row("bench report: --out equal to the store", "bench.py",
        lambda w: ["report", str(w.root / "store"), "--out", str(w.root / "store")], 2,
        lambda w: "is the results store"),
    Row("bench report: DIR missing", "bench.py", lambda w: ["report", str(w.root / "nope")], 2,
        lambda w: "not a directory; pass the results store directory"),
    Row("bench import: path missing", "bench.py", lambda w: ["import", str(w.root / "nope.json")], 2,
        lambda w: "does not exist"),
    Row("bench fetch-prompts: --manifest missing", "bench.py",
        lambda w: ["fetch-prompts", "--source", "specbench", "--dest", str(w.root / "sb.jsonl"),
                   "--manifest", str(w.root / "none.json")], 2, lambda w: "--manifest"),
    Row("bench fetch-prompts: --dest a directory", "bench.py",
        lambda w: ["fetch-prompts", "--source", "specbench", "--dest", str(w.foreign)], 2,
        lambda w: "is a directory"),
    Row("gb10_exporter: --port out of range", "gb10_exporter.py", lambda w: ["--port", "70000"], 2,
        lambda w: "--port 70000 is out of range: give 1..65535"),
    Row("gb10_exporter: --once with nothing readable", "gb10_exporter.py",
        lambda w: ["--once", "--nvidia-smi", str(w.root / "no-smi"), "--meminfo", str(w.root / "none")], 1,
        lambda w: "read nothing: nvidia-smi"),
]


def prepare(w: World) -> None:
    """Inputs some rows need: a fetched directory, a plain (foreign) checkpoint, a results store."""
    fetched = w.root / "fetched"
    fetched.mkdir()
    (fetched / MARKER).write_text('{"tool": "fetch_checkpoint"}')
    (fetched / "x.txt").write_text("fetched")
    plain = w.root / "plain"
    shutil.copytree(w.merged, plain)
    for name in (MARKER, ".sparkllm_merge.json", ck.EXTRA_FILE):
        (plain / name).unlink()
    doc = json.loads((plain / INDEX_NAME).read_text())
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if not k.startswith("mtp.")}
    (plain / INDEX_NAME).write_text(json.dumps(doc))
    short = w.root / "int4-short"  # an INT4 checkpoint whose index names a shard that is gone
    shutil.copytree(w.pair.int4_dir, short)
    (short / "model-00002-of-00003.safetensors").unlink()
    store = w.root / "store"
    store.mkdir()
    bench_store.open_store(store).close()


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input(world: World, row: Row) -> None:
    prepare(world)
    before = tree(world.root)
    r = run(row.script, *row.args(world))
    err = r.stderr.strip().splitlines()
    assert r.returncode == row.rc, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert len(err) == 1, r.stderr  # one line
    assert row.needle(world) in err[0], err[0]
    assert tree(world.root) == before  # nothing outside the tool's own output changed; nothing left behind


def test_bench_run_all_requests_failed_is_written_invalid_and_exits_1(world: World) -> None:
    out = world.root / "results"
    with StandinServer(Config(error_every=1, step_time=0.001, model="m")) as srv:
        before = tree(world.root)
        r = run("bench.py", "run", "--base-url", srv.base_url, "--model", "m", "--label", "x",
                "--out", str(out), "--prompts", str(world.prompts), "--warmup", "0", "--max-tokens", "4",
                "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "is invalid" in err[0] and "request(s) failed" in err[0], r.stderr
    files = list(out.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["valid"] is False  # written, marked invalid
    changed = {k for k, v in tree(world.root).items() if before.get(k) != v}
    assert changed and all(k.startswith("results") for k in changed)  # only its own output


def test_report_without_matplotlib_is_markdown_with_one_line(world: World, monkeypatch, capsys) -> None:
    from tests.unit.bench_helpers import fake_doc

    store = world.root / "store2"
    conn = bench_store.open_store(store)
    bench_store.store_run(conn, fake_doc("baseline", 1, [10.0, 11.0]))
    conn.close()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench.main(["report", str(store)]) == 0
    md = (store / "report" / "report.md").read_text()
    assert bench_report.NO_MATPLOTLIB in md and "## Charts" not in md
    assert not list((store / "report").glob("*.png"))
    captured = capsys.readouterr()
    assert captured.err.strip() == bench_report.NO_MATPLOTLIB
    assert f"wrote {store / 'report' / 'report.md'}" in captured.out
    # a rerun replaces its own earlier report; a legacy (unmarked) report directory is ours too
    (store / "report" / MARKER).unlink()
    assert bench.main(["report", str(store), "--no-charts"]) == 0
    assert json.loads((store / "report" / MARKER).read_text())["tool"] == "bench.py report"
    assert not [p for p in store.iterdir() if p.name.startswith(".report")]


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for name, p in [("bench.py", bench.build_parser()), ("sweep.py", sweep.build_parser()),
                    ("tune.py", tune.build_parser()),
                    ("fetch_checkpoint.py", fetch_checkpoint.build_parser()),
                    ("hybrid_merge.py", hybrid_merge.build_parser()),
                    ("mtp_index_patch.py", mtp_index_patch.build_parser()),
                    ("verify_checkpoint.py", verify_checkpoint.build_parser()),
                    ("model_job.py", model_job.build_parser()), ("serve_wait.py", serve_wait.build_parser()),
                    ("gb10_exporter.py", gb10_exporter.build_parser())]:
        out.append((name, p))
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += [(f"{name} {sub}", sp) for sub, sp in action.choices.items()]
    return out


@pytest.mark.parametrize(("name", "parser"), parsers(), ids=[n for n, _ in parsers()])
def test_every_option_help_names_its_default(name: str, parser: argparse.ArgumentParser) -> None:
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.required or isinstance(action, argparse._HelpAction):
            continue
        help_text = " ".join(parser._get_formatter()._expand_help(action).split())
        assert "default" in help_text, f"{name} {action.option_strings[0]}: {help_text!r}"
        # argparse's textwrap may break a long path at a hyphen ("ci-clone" -> "ci- clone"): compare
        # with all whitespace removed, so the check does not depend on where the checkout lives
        assert "".join(help_text.split()) in "".join(text.split())
