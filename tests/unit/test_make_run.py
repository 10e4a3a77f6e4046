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
    # the real inventory reader: make_run asks it whether the inventory names a Spark
    (b / "ansible-inventory").symlink_to(Path(sys.executable).parent / "ansible-inventory")
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
    inv = Path(f"{tmp_path}/x.yml; touch {mark}")  # a real inventory at that odd path
    inv.parent.mkdir(parents=True)
    shutil.copy(ROOT / "inventory" / "hosts.yml", inv)
    r, calls = make(fake_bin, "check", f"INVENTORY={inv}")
    assert r.returncode == 0 and not mark.exists(), r.stderr
    assert calls[0][:2] == ["-i", str(inv)] and "--check" in calls[0]


# An inventory that names no Spark made every play skip ("no hosts matched") with rc 0 (issue 46, 10).
NO_SPARK = [
    (None, "no such file"),
    ("spark: [oops\n  hosts: {a: {}\n", "Ansible cannot read it as an inventory"),
    ("sparks:\n  hosts:\n    spark-01:\n      ansible_host: spark-01.lan\n", "no host in the group `spark`"),
    ("spark:\n  hosts: {}\n", "no host in the group `spark`"),
]


@pytest.mark.parametrize(("text", "needle"), NO_SPARK, ids=["missing", "not-yaml", "sparks", "empty"])
def test_an_inventory_without_a_spark_stops_before_any_play(fake_bin: Path, tmp_path: Path, text: str | None,
                                                            needle: str) -> None:
    inv = tmp_path / "my-sparks.yml"
    if text is not None:
        inv.write_text(text)
    for target in ("deploy", "check"):
        r, calls = make(fake_bin, target, f"INVENTORY={inv}")
        assert calls == [], r.stdout  # ansible-playbook never ran
        err = [line for line in r.stderr.splitlines() if line.startswith("make_run:")]
        assert len(err) == 1 and needle in err[0] and str(inv) in err[0], r.stderr
        assert "`spark`" in err[0] and "inventory/examples/" in err[0], err[0]
    with pytest.raises(make_run.Refused, match=needle):
        make_run.check_inventory(str(inv), str(fake_bin))


def test_a_missing_inventory_exits_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setenv("INVENTORY", str(tmp_path / "nope.yml"))
    monkeypatch.setenv("SPEC_METHOD", "mtp")
    monkeypatch.setattr(make_run.os, "execv", lambda *a: pytest.fail(f"ran {a}"))  # never replace pytest
    monkeypatch.setenv("BIN", str(Path(sys.executable).parent))
    assert make_run.main(["deploy"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_an_inventory_with_sparks_in_child_groups_passes(fake_bin: Path, tmp_path: Path) -> None:
    inv = tmp_path / "two.yml"
    shutil.copy(ROOT / "inventory" / "examples" / "two-sparks.yml", inv)
    r, calls = make(fake_bin, "deploy", f"INVENTORY={inv}")
    assert r.returncode == 0, r.stderr
    assert calls[0][:2] == ["-i", str(inv)]


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


def test_tune_runs_the_tune_script_with_the_inventory_and_args(fake_bin: Path, tmp_path: Path) -> None:
    inv = tmp_path / "hosts.yml"
    inv.write_text("spark:\n  hosts:\n    spark-1:\n      ansible_connection: local\n")
    env = {"INVENTORY": str(inv), "BIN": str(fake_bin), "ARGS": "--quick --heads int8"}
    argv = make_run.build_argv("tune", env)
    assert argv == [str(fake_bin / "python"), "scripts/tune.py", "--inventory", str(inv),
                    "--quick", "--heads", "int8"]
    with pytest.raises(make_run.Refused, match="INVENTORY"):
        make_run.build_argv("tune", {"INVENTORY": "-x", "BIN": str(fake_bin)})
    r, _ = make(fake_bin, "tune", f"INVENTORY={inv}", "ARGS=--dry-run --quick")
    assert r.returncode == 0, r.stderr
    assert "scripts/tune.py --inventory" in r.stdout and "estimate:" in r.stdout
