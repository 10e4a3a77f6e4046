"""The one import configuration of the tests (docs/layout.md): pyproject.toml's pytest pythonpath."""

from __future__ import annotations

import re
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHONPATH = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"][
    "ini_options"]["pythonpath"]
SYS_PATH_EDIT = re.compile(r"^\s*sys\.path(\.insert|\.append|\[)", re.M)


def test_no_test_file_edits_sys_path():
    files = [*ROOT.glob("tests/**/test_*.py"), *ROOT.glob("tests/**/conftest.py")]
    assert len(files) > 50
    edits = [f.relative_to(ROOT).as_posix() for f in files
             if SYS_PATH_EDIT.search(f.read_text(encoding="utf-8"))]
    assert not edits, f"{edits} edit sys.path: add the folder to pythonpath in pyproject.toml instead"


def test_no_two_import_roots_hold_a_module_of_the_same_name():
    where = defaultdict(list)
    for root in PYTHONPATH:
        for p in (ROOT / root).iterdir():
            name = p.stem if p.suffix == ".py" else p.name if (p / "__init__.py").is_file() else None
            if name and name not in ("conftest", "__init__"):
                where[name].append(root)
    twice = {n: r for n, r in where.items() if len(r) > 1}
    assert not twice, f"one import name, several pythonpath folders: {twice}"
