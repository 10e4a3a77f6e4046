"""The vLLM patch series under patches/: present, listed, well-formed unified diffs.

Whether the patches apply to, and work with, the real vLLM is the contract tests' job
(tests/contract/test_inc_hybrid_patch_contract.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"
VERSION_DIRS = sorted(p for p in PATCHES.glob("vllm-*") if p.is_dir())
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def series(directory: Path) -> list[str]:
    return [ln.strip() for ln in (directory / "series").read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def parse_unified_diff(text: str) -> list[dict]:
    """Files of a unified diff with their hunks; raises AssertionError on malformed input."""
    lines = text.splitlines()
    files: list[dict] = []
    i = 0
    while i < len(lines) and not lines[i].startswith(("diff --git ", "--- ")):
        i += 1  # description above the first diff
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            i += 1
            continue
        if line.startswith(("index ", "new file mode", "deleted file mode", "old mode", "new mode")):
            i += 1
            continue
        assert line.startswith("--- "), f"line {i + 1}: expected '--- a/...', got {line!r}"
        assert lines[i + 1].startswith("+++ "), f"line {i + 2}: expected '+++ b/...'"
        old, new = line[4:].split("\t")[0], lines[i + 1][4:].split("\t")[0]
        entry = {"old": old, "new": new, "hunks": 0}
        files.append(entry)
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK.match(lines[i])
            assert m, f"line {i + 1}: bad hunk header {lines[i]!r}"
            old_n = int(m.group(2) if m.group(2) is not None else 1)
            new_n = int(m.group(4) if m.group(4) is not None else 1)
            i += 1
            while old_n > 0 or new_n > 0:
                assert i < len(lines), "hunk ends early"
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                tag = body[:1] if body else " "
                assert tag in " +-", f"line {i + 1}: unexpected {body!r} inside a hunk"
                if tag in " -":
                    old_n -= 1
                if tag in " +":
                    new_n -= 1
                assert old_n >= 0 and new_n >= 0, f"line {i + 1}: hunk longer than its header says"
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                i += 1
            entry["hunks"] += 1
        assert entry["hunks"] > 0, f"{old}: no hunks"
    return files


INC_VERSIONS = ["0.19.1", "0.20.0", "0.26.0"]
# 0.26.0 moved the INC config into a package (quantization/inc/inc.py)
INC_FILE = {"0.26.0": "b/vllm/model_executor/layers/quantization/inc/inc.py"}
LOG_FORMAT = '"INC: hybrid checkpoint: found %d FP8 layers (F8_E4M3, %dx%d block "'


@pytest.mark.parametrize("version", INC_VERSIONS)
def test_there_is_a_series_with_the_inc_patch(version):
    assert (PATCHES / f"vllm-{version}" / "series").is_file()
    assert "0001-inc-hybrid-fp8.patch" in series(PATCHES / f"vllm-{version}")
    assert (PATCHES / "README.md").is_file()
    assert f"| {version} |" in (PATCHES / "README.md").read_text()


@pytest.mark.parametrize("directory", VERSION_DIRS, ids=[d.name for d in VERSION_DIRS])
def test_series_lists_exactly_the_patch_files(directory):
    listed = series(directory)
    assert listed, f"{directory}/series is empty"
    assert len(listed) == len(set(listed)), "a patch is listed twice"
    on_disk = sorted(p.name for p in directory.glob("*.patch"))
    assert sorted(listed) == on_disk
    assert listed == sorted(listed), "series order should follow the NNNN- numbering"
    for name in listed:
        assert re.fullmatch(r"\d{4}-[a-z0-9-]+\.patch", name), name


@pytest.mark.parametrize(
    "patch", [p for d in VERSION_DIRS for p in sorted(d.glob("*.patch"))],
    ids=lambda p: f"{p.parent.name}/{p.name}")
def test_patch_is_a_well_formed_unified_diff(patch):
    text = patch.read_text()
    assert text.endswith("\n")
    files = parse_unified_diff(text)
    assert files
    for f in files:
        # paths relative to the vLLM repo root, git style (git apply / patch -p1)
        assert f["new"].startswith("b/vllm/"), f
        if f["old"] != "/dev/null":  # /dev/null: a file the patch adds
            assert f["old"].startswith("a/vllm/") and f["old"][2:] == f["new"][2:], f
    assert "\r" not in text


@pytest.mark.parametrize("version", INC_VERSIONS)
def test_inc_patch_targets_inc_py_and_says_what_it_does(version):
    patch = PATCHES / f"vllm-{version}" / "0001-inc-hybrid-fp8.patch"
    text = patch.read_text()
    files = parse_unified_diff(text)
    assert [f["new"] for f in files] == [
        INC_FILE.get(version, "b/vllm/model_executor/layers/quantization/inc.py")]
    header = text.split("diff --git", 1)[0]
    assert "Subject:" in header and "FP8" in header
    added = "\n".join(ln for ln in text.splitlines() if ln.startswith("+"))
    for needle in ("def maybe_update_config", "weight_scale_inv", "F8_E4M3", "Fp8Config",
                   'activation_scheme="dynamic"', "weight_block_size", "logger.info"):
        assert needle in added, needle
    # the GPU end-to-end script greps "found (\\d+) FP8 layers": same log text in every version
    assert LOG_FORMAT in added


@pytest.mark.parametrize("version", ["0.20.0", "0.26.0"])
def test_inc_patch_takes_the_hf_config_keyword(version):
    """vLLM 0.20.0 and 0.26.0 call quant_config.maybe_update_config(model, hf_config=...)."""
    added = "\n".join(ln for ln in (PATCHES / f"vllm-{version}" / "0001-inc-hybrid-fp8.patch")
                      .read_text().splitlines() if ln.startswith("+"))
    assert 'hf_config: "PretrainedConfig | None" = None' in added


LM_HEAD_SOURCE = PATCHES / "src" / "sparkllm_lm_head_int8.py"
LM_HEAD_LOG = '"sparkllm: lm_head INT8 (per-row), %dx%d in %s (%s), kernel %s, weight max abs err "'


MODULE_DEST = "vllm/model_executor/layers/sparkllm_lm_head_int8.py"
MODULE_IMPORT = "    from vllm.model_executor.layers import sparkllm_lm_head_int8"


def module_manifest() -> dict[str, str]:
    """patches/src/modules: file in patches/src -> where apply_patches.sh installs it."""
    entries = {}
    for line in (PATCHES / "src" / "modules").read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            assert len(fields) == 2, line
            entries[fields[0]] = fields[1]
    return entries


@pytest.mark.parametrize("version", INC_VERSIONS)
def test_lm_head_patch_holds_only_the_call_site(version):
    """The module is carried once (patches/src, installed by apply_patches.sh); each version's 0002 is
    the hook in process_weights_after_loading and nothing else."""
    patch = PATCHES / f"vllm-{version}" / "0002-int8-lm-head.patch"
    assert series(PATCHES / f"vllm-{version}")[-1] == patch.name
    text = patch.read_text()
    files = parse_unified_diff(text)
    assert [(f["old"], f["new"]) for f in files] == [
        ("a/vllm/model_executor/model_loader/utils.py", "b/vllm/model_executor/model_loader/utils.py"),
    ]
    header = text.split("diff --git", 1)[0]
    assert "Subject:" in header and "SPARKLLM_LM_HEAD_INT8" in header
    hook = text.split("+++ b/vllm/model_executor/model_loader/utils.py", 1)[1]
    added = [ln[1:] for ln in hook.splitlines() if ln.startswith("+")]
    assert MODULE_IMPORT in added
    assert "    if sparkllm_lm_head_int8.enabled():" in added
    assert "        sparkllm_lm_head_int8.quantize_lm_heads(model)" in added
    assert not [ln for ln in hook.splitlines() if ln.startswith("-")], "the hook only adds lines"
    # the call site imports the module from where the manifest installs it
    assert module_manifest()["sparkllm_lm_head_int8.py"] == MODULE_DEST
    package, module = re.fullmatch(r"from (\S+) import (\w+)", MODULE_IMPORT.strip()).groups()
    assert f"{package.replace('.', '/')}/{module}.py" == MODULE_DEST


@pytest.mark.parametrize("directory", VERSION_DIRS, ids=lambda d: d.name)
def test_no_patch_embeds_a_carried_module(directory):
    """A module of patches/src is carried once: no patch creates a file the manifest installs, and no
    patch adds a run of the module's own lines (a copy pasted into another file)."""
    dests = {f"b/{d}" for d in module_manifest().values()}
    module_lines = {name: [ln for ln in (PATCHES / "src" / name).read_text().splitlines()
                           if len(ln.strip()) > 20]
                    for name in module_manifest()}
    for name in series(directory):
        text = (directory / name).read_text()
        created = {f["new"] for f in parse_unified_diff(text)}
        assert not created & dests, f"{name} creates {created & dests}, which patches/src/modules installs"
        added = {ln[1:] for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")}
        for module, lines in module_lines.items():
            shared = sum(1 for ln in lines if ln in added)
            assert shared < 10, f"{name} adds {shared} lines of patches/src/{module}: carry it once, call it"


def test_every_module_in_the_manifest_exists_and_is_python():
    manifest = module_manifest()
    assert manifest, "patches/src/modules lists no module"
    for name, dest in manifest.items():
        assert (PATCHES / "src" / name).is_file(), name
        assert dest.startswith("vllm/") and dest.endswith(".py") and ".." not in dest, dest
    # and nothing in patches/src is left out of the manifest (it would never reach the image)
    assert {p.name for p in (PATCHES / "src").iterdir() if p.name != "modules"} == set(manifest)


def test_lm_head_module_says_what_it_logs():
    source = LM_HEAD_SOURCE.read_text()
    # the GPU end-to-end check greps this line (tests/gpu/e2e.py LM_HEAD_LOG_RE)
    assert LM_HEAD_LOG in source
    assert 'ENV = "SPARKLLM_LM_HEAD_INT8"' in source


@pytest.mark.parametrize("bad", [
    "--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n+b\n",          # hunk shorter than its header
    "--- a/x\n@@ -1 +1 @@\n-a\n+b\n",                        # no +++ line
    "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n?junk\n",        # junk where the next file should be
    "--- a/x\n+++ b/x\n",                                     # no hunks
])
def test_parser_rejects_malformed_diffs(bad):
    with pytest.raises(AssertionError):
        parse_unified_diff(bad)


@pytest.mark.parametrize("directory", VERSION_DIRS, ids=lambda d: d.name)
def test_patches_touch_only_python_files(directory):
    """The image applies the series to the installed package after the compile (templates/Dockerfile.j2,
    stage `patched`): a patch of C++/CUDA sources would be silently meaningless there."""
    for name in series(directory):
        for entry in parse_unified_diff((directory / name).read_text()):
            assert entry["new"].endswith(".py") and entry["new"].startswith("b/vllm/"), (
                f"{directory.name}/{name} touches {entry['new']}: only Python files under vllm/ can be "
                f"patched in the installed package; a compiled-source change belongs in the build stage")


def test_the_python_only_check_catches_a_kernel_patch():
    text = ("diff --git a/csrc/x.cu b/csrc/x.cu\n--- a/csrc/x.cu\n+++ b/csrc/x.cu\n@@ -1 +1 @@\n-a\n+b\n")
    (entry,) = parse_unified_diff(text)
    assert not entry["new"].endswith(".py")
