"""The Makefile's user variables never reach a shell: real `make` runs with a fake ansible-playbook.

Each case runs `make` on the project's Makefile with BIN pointing at a directory holding a fake
`ansible-playbook` (it records its argv) and `python` (this interpreter); the values carry shell
metacharacters that, pasted into a recipe line, would run `touch MARK` or comment out `--check`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import make_run
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    b = tmp_path / "bin"
    b.mkdir()
    (b / "python").symlink_to(sys.executable)
    tool = b / "ansible-playbook"
    tool.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "with open(os.environ['RECORD'], 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    tool.chmod(0o755)
    (b / ".stamp").touch()  # newer than requirements.txt: `setup` has nothing to do
    return b


def make(fake_bin: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    record = fake_bin.parent / "argv.jsonl"
    record.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("ARGS", "SPEC_METHOD", "INVENTORY", "MAKEFLAGS")}
    env["RECORD"] = str(record)
    r = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), f"BIN={fake_bin}", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return r, calls


BASE = ["-i", "inventory/hosts.yml", "site.yml"]


def test_deploy_and_check_argv(fake_bin: Path) -> None:
    r, calls = make(fake_bin, "deploy", "SPEC_METHOD=ngram")
    assert r.returncode == 0, r.stderr
    assert calls == [[*BASE, "-e", "spec_method=ngram"]]
    r, calls = make(fake_bin, "check")
    assert r.returncode == 0, r.stderr
    assert calls == [[*BASE, "-e", "spec_method=mtp", "--check", "--diff"]]  # the default method


def test_args_are_split_like_words_and_never_executed(fake_bin: Path, tmp_path: Path) -> None:
    mark = tmp_path / "MARK"
    r, calls = make(fake_bin, "check", f"ARGS=--tags serve; touch {mark} #")
    assert r.returncode == 0, r.stderr
    assert calls == [
        [*BASE, "-e", "spec_method=mtp", "--check", "--diff", "--tags", "serve;", "touch", str(mark), "#"]
    ]
    assert not mark.exists()
    r, calls = make(
        fake_bin, "deploy", """ARGS=-e '{"spark_monitoring_enabled": true}' --tags serve,monitoring"""
    )
    assert r.returncode == 0, r.stderr
    assert calls[0][-4:] == ["-e", '{"spark_monitoring_enabled": true}', "--tags", "serve,monitoring"]
    assert "--check" not in calls[0]
    r, calls = make(fake_bin, "check", f"ARGS=$(touch {mark}) `touch {mark}` $(shell touch {mark})")
    assert r.returncode == 0 and not mark.exists()
    # words, as a shell splits them; make's own $(shell ...) is not expanded either
    assert calls[0][-7:] == ["$(touch", f"{mark})", "`touch", f"{mark}`", "$(shell", "touch", f"{mark})"]


@pytest.mark.parametrize(
    ("var", "needle"),
    [
        ("SPEC_METHOD=mtp; touch {mark} #", "SPEC_METHOD='mtp; touch"),
        ("SPEC_METHOD=mtp --check", "not a method name"),
        ("SPEC_METHOD=", "not a method name"),
        ("INVENTORY=--list-hosts", "INVENTORY='--list-hosts': not an inventory path"),
        ("ARGS=--tags 'serve", 'ARGS="--tags \'serve": No closing quotation'),
        ("ARGS=-e ansible_check_mode=false", "sets ansible_check_mode"),
    ],
)
def test_bad_values_refused_before_anything_runs(
    fake_bin: Path, tmp_path: Path, var: str, needle: str
) -> None:
    mark = tmp_path / "MARK"
    for target in ("check", "deploy"):
        r, calls = make(fake_bin, target, var.format(mark=mark))
        assert r.returncode == 2, r.stderr
        assert calls == [] and not mark.exists()
        err = [line for line in r.stderr.splitlines() if line.startswith("make_run:")]
        assert len(err) == 1 and needle in err[0], r.stderr


def test_inventory_with_shell_characters_is_one_argument(fake_bin: Path, tmp_path: Path) -> None:
    mark = tmp_path / "MARK"
    r, calls = make(fake_bin, "check", f"INVENTORY=x.yml; touch {mark}")
    assert r.returncode == 0 and not mark.exists()
    assert calls[0][:2] == ["-i", f"x.yml; touch {mark}"] and "--check" in calls[0]


def test_python_variable_is_one_word(fake_bin: Path, tmp_path: Path) -> None:
    mark = tmp_path / "MARK"
    r, calls = make(fake_bin, "gpu-e2e", f"PYTHON=true; touch {mark}")
    assert r.returncode != 0 and not mark.exists() and calls == []


def test_gpu_target_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = make_run.build_argv("gpu-dflash", {"ARGS": "--cases 'a b'"})
    assert argv == [
        sys.executable,
        "tests/gpu/dflash_bench.py",
        "--out",
        "results/gpu-dflash",
        "--cases",
        "a b",
    ]
    # a target's own arguments come first, so ARGS can still override them (argparse: the last wins)
    argv = make_run.build_argv("gpu-dflash-graph", {"ARGS": "--budget 590"})
    assert argv[2:] == ["--out", "results/gpu-dflash-graph", "--cases", "base,dflash-graph", "--no-bench",
                        "--budget", "590"]
    with pytest.raises(make_run.Refused, match="unknown"):
        make_run.build_argv("nope", {})
