"""filter_plugins/spark_tools.py: the tools role copies exactly the files the Spark lacks or holds wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spark_tools import (
    FilterModule,
    spark_tools_dirs,
    spark_tools_files,
    spark_tools_probe,
    spark_tools_stale,
)

ROOT = Path(__file__).resolve().parents[2]


def _scripts(tmp_path: Path) -> Path:
    src = tmp_path / "scripts"
    (src / "sparkllm").mkdir(parents=True)
    (src / "a.py").write_text("print('a')\n")
    (src / "b.py").write_text("print('b')\n")
    (src / "sparkllm" / "x.py").write_text("X = 1\n")
    (src / "sparkllm" / "w.py").write_text("W = 1\n")
    (src / "sparkllm" / "notes.txt").write_text("not a module\n")
    return src


def _probe(dest: Path, files: list[dict]) -> dict:
    out = subprocess.run([sys.executable, "-c", spark_tools_probe(), str(dest), *[f["dest"] for f in files]],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _as_root(present: dict) -> dict:
    """The test runs as whoever runs it; the role runs as root: count this user's files as root's."""
    me = (os.getuid(), os.getgid())
    return {k: [h, m, *([0, 0] if (u, g) == me else [u, g])] for k, (h, m, u, g) in present.items()}


def test_files_lists_the_tools_then_the_package_modules(tmp_path: Path) -> None:
    src = _scripts(tmp_path)
    got = spark_tools_files(str(src), ["b.py", "a.py"])
    assert [(f["dest"], f["mode"]) for f in got] == [
        ("b.py", "0755"), ("a.py", "0755"), ("sparkllm/w.py", "0644"), ("sparkllm/x.py", "0644")]
    assert got[0]["src"] == str(src / "b.py")


def test_files_and_dirs_take_the_subpackages_too(tmp_path: Path) -> None:
    src = _scripts(tmp_path)
    (src / "sparkllm" / "bench").mkdir()
    (src / "sparkllm" / "bench" / "__init__.py").write_text("")
    (src / "sparkllm" / "bench" / "runner.py").write_text("R = 1\n")
    (src / "sparkllm" / "bench" / "__pycache__").mkdir()
    (src / "sparkllm" / "bench" / "__pycache__" / "stale.py").write_text("")
    got = spark_tools_files(str(src), ["a.py"])
    assert [f["dest"] for f in got] == ["a.py", "sparkllm/bench/__init__.py", "sparkllm/bench/runner.py",
                                        "sparkllm/w.py", "sparkllm/x.py"]
    assert spark_tools_dirs(got, "/opt/t/") == ["/opt/t/sparkllm", "/opt/t/sparkllm/bench"]


def test_the_copied_tools_run_without_the_checkout(tmp_path: Path) -> None:
    """The role's file list, copied as the role copies it, is enough for the tools to start (no repo on
    sys.path: -E ignores PYTHONPATH, -s the user's site)."""
    import shutil

    import yaml
    defaults = yaml.safe_load((ROOT / "roles/spark_tools/defaults/main.yml").read_text())
    scripts = defaults["spark_tools_scripts"]
    dest = tmp_path / "tools"
    files = spark_tools_files(str(ROOT / "scripts"), scripts)
    for d in spark_tools_dirs(files, str(dest)):
        Path(d).mkdir(parents=True, exist_ok=True)
    dest.mkdir(exist_ok=True)
    for f in files:
        shutil.copyfile(f["src"], dest / f["dest"])
    for tool in ("bench.py", "fetch_checkpoint.py", "verify_checkpoint.py"):
        if tool in scripts:
            res = subprocess.run([sys.executable, "-E", "-s", tool, "--help"], cwd=dest, capture_output=True,
                                 text=True, check=False)
            assert res.returncode == 0, f"{tool}: {res.stderr}"


def test_files_names_a_listed_tool_that_is_not_there(tmp_path: Path) -> None:
    src = _scripts(tmp_path)
    with pytest.raises(ValueError, match=r"not in .*: gone\.py"):
        spark_tools_files(str(src), ["a.py", "gone.py"])
    with pytest.raises(ValueError, match="list of file names"):
        spark_tools_files(str(src), "a.py")  # type: ignore[arg-type]


def test_only_missing_changed_or_wrong_mode_files_are_stale(tmp_path: Path) -> None:
    src = _scripts(tmp_path)
    files = spark_tools_files(str(src), ["a.py", "b.py"])
    dest = tmp_path / "dest"
    assert [f["dest"] for f in spark_tools_stale(files, _as_root(_probe(dest, files)))] == [
        "a.py", "b.py", "sparkllm/w.py", "sparkllm/x.py"]  # a fresh Spark: everything
    (dest / "sparkllm").mkdir(parents=True)
    for f in files:
        target = dest / f["dest"]
        target.write_bytes(Path(f["src"]).read_bytes())
        target.chmod(int(f["mode"], 8))
    assert spark_tools_stale(files, _as_root(_probe(dest, files))) == []  # a rerun: nothing
    (dest / "b.py").write_text("print('edited on the Spark')\n")
    (dest / "sparkllm" / "x.py").chmod(0o666)
    (src / "sparkllm" / "w.py").write_text("W = 2\n")  # a new release of the toolkit
    present = _as_root(_probe(dest, files))
    stale = [f["dest"] for f in spark_tools_stale(files, present)]
    assert stale == ["b.py", "sparkllm/w.py", "sparkllm/x.py"]
    present["a.py"][2] = 1000  # owned by somebody else
    assert "a.py" in [f["dest"] for f in spark_tools_stale(files, present)]


def test_stale_rejects_what_is_not_a_list_and_a_mapping() -> None:
    with pytest.raises(ValueError, match="list of files"):
        spark_tools_stale("a.py", {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probe's mapping"):
        spark_tools_stale([], "{}")  # type: ignore[arg-type]


def test_the_real_tool_list_resolves() -> None:
    import yaml
    defaults = yaml.safe_load((ROOT / "roles/spark_tools/defaults/main.yml").read_text())
    scripts = defaults["spark_tools_scripts"]
    got = spark_tools_files(str(ROOT / "scripts"), scripts)
    assert {f["dest"] for f in got} >= {"bench.py", "sparkllm/bench/runner.py", "sparkllm/fileio.py"}
    assert set(FilterModule().filters()) == {"spark_tools_files", "spark_tools_dirs", "spark_tools_stale",
                                             "spark_tools_probe"}
