"""roles/vllm_build/files/apply_patches.sh: the modules of patches/src are installed once, before the
series, where patches/src/modules says; a missing or clashing module stops the build naming it
(SPARKLLM-PATCH-FAILED, what the role looks for). Real script, real git apply, real files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "roles" / "vllm_build" / "files" / "apply_patches.sh"
PATCHES = ROOT / "patches"
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

CALLER = "pkg/caller.py"
HOOK = """\
diff --git a/pkg/caller.py b/pkg/caller.py
--- a/pkg/caller.py
+++ b/pkg/caller.py
@@ -1 +1,2 @@
 x = 1
+from pkg.sub import helper  # noqa
"""


def run(patch_dir: Path, tree: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(SCRIPT), str(patch_dir), str(tree), *extra], capture_output=True,
                          text=True, check=False)


@pytest.fixture
def layout(tmp_path):
    tree = tmp_path / "site"
    (tree / "pkg" / "sub").mkdir(parents=True)
    (tree / CALLER).write_text("x = 1\n")
    pdir = tmp_path / "patches"
    (pdir / "src").mkdir(parents=True)
    (pdir / "0001-hook.patch").write_text(HOOK)
    (pdir / "series").write_text("0001-hook.patch\n")
    (pdir / "src" / "helper.py").write_text("VALUE = 42\n")
    (pdir / "src" / "modules").write_text("# comment\nhelper.py pkg/sub/helper.py\n")
    return tree, pdir


def test_modules_are_installed_before_the_series(layout):
    tree, pdir = layout
    res = run(pdir, tree)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tree / "pkg/sub/helper.py").read_text() == "VALUE = 42\n"
    assert "from pkg.sub import helper" in (tree / CALLER).read_text()
    out = res.stdout
    assert out.index("installed src/helper.py as pkg/sub/helper.py") < out.index("applied 0001-hook.patch")
    assert not list(tree.rglob("*.sparkllm-tmp"))


def test_a_separate_module_dir_is_honoured(layout, tmp_path):
    tree, pdir = layout
    moved = tmp_path / "elsewhere"
    shutil.move(str(pdir / "src"), moved)
    assert run(pdir, tree, str(moved)).returncode == 0
    assert (tree / "pkg/sub/helper.py").is_file()


def test_a_missing_module_stops_the_build_naming_it(layout):
    tree, pdir = layout
    (pdir / "src" / "helper.py").unlink()
    res = run(pdir, tree)
    assert res.returncode == 1
    assert "SPARKLLM-PATCH-FAILED: src/helper.py (listed in src/modules, file missing)" in res.stdout
    assert "from pkg.sub" not in (tree / CALLER).read_text()  # nothing of the series was applied


def test_a_file_it_did_not_create_is_not_replaced(layout):
    tree, pdir = layout
    (tree / "pkg/sub/helper.py").write_text("somebody else's\n")
    res = run(pdir, tree)
    assert res.returncode == 1
    assert "pkg/sub/helper.py already exists with other content" in res.stdout
    assert (tree / "pkg/sub/helper.py").read_text() == "somebody else's\n"


def test_the_same_module_already_there_is_accepted(layout):
    tree, pdir = layout
    (tree / "pkg/sub/helper.py").write_text("VALUE = 42\n")
    assert run(pdir, tree).returncode == 0


@pytest.mark.parametrize("line", ["helper.py /etc/evil.py", "helper.py ../outside.py",
                                  "helper.py a/../../x.py", "helper.py", "helper.py a.py extra"])
def test_bad_manifest_lines_are_refused(layout, line):
    tree, pdir = layout
    (pdir / "src" / "modules").write_text(line + "\n")
    res = run(pdir, tree)
    assert res.returncode == 1
    assert "SPARKLLM-PATCH-FAILED: src/modules" in res.stdout
    assert not (tree.parent / "outside.py").exists()


def test_usage_errors_exit_2():
    assert subprocess.run(["sh", str(SCRIPT)], capture_output=True, check=False).returncode == 2


@pytest.mark.parametrize("version", ["0.19.1", "0.20.0", "0.26.0"])
def test_the_real_manifest_installs_the_lm_head_module_where_0002_imports_it(version, tmp_path):
    """patches/src as the image gets it: the module lands where every version's call site imports it.
    (That the series then applies to each real vLLM is the contract tests' job.)"""
    tree = tmp_path / "site"
    tree.mkdir()
    empty = tmp_path / "no-series"
    empty.mkdir()
    (empty / "series").write_text("")
    res = run(empty, tree, str(PATCHES / "src"))
    assert res.returncode == 0, res.stdout
    installed = tree / "vllm/model_executor/layers/sparkllm_lm_head_int8.py"
    assert installed.read_bytes() == (PATCHES / "src" / "sparkllm_lm_head_int8.py").read_bytes()
    call_site = (PATCHES / f"vllm-{version}" / "0002-int8-lm-head.patch").read_text()
    assert "+    from vllm.model_executor.layers import sparkllm_lm_head_int8\n" in call_site
