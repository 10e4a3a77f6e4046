"""mtp_index_patch: script and Ansible module (check mode, diff, idempotence)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import ansible.module_utils
import hybrid_merge
import mtp_index_patch
import pytest
from ansible.module_utils.testing import patch_module_args
from sparkllm.checkpoint import hybrid as ck
from sparkllm.checkpoint.safetensors_io import INDEX_NAME, read_header, read_index

from tests.fixtures.make_checkpoints import GenConfig, GeneratedPair, generate

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mtp_index_patch.py"


@pytest.fixture
def pair(tmp_path: Path) -> GeneratedPair:
    return generate(tmp_path / "src", GenConfig(layers=4, experts=4))


@pytest.fixture
def hybrid_without_mtp(pair: GeneratedPair, tmp_path: Path) -> Path:
    """A merge output as the published recipe leaves it: MTP file and names dropped."""
    out = tmp_path / "hybrid"
    assert (
        hybrid_merge.main(["--int4", str(pair.int4_dir), "--fp8", str(pair.fp8_dir), "--out", str(out)]) == 0
    )
    (out / ck.EXTRA_FILE).unlink()
    doc = json.loads((out / INDEX_NAME).read_text())
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if not k.startswith("mtp.")}
    doc["metadata"]["total_size"] = 12345  # wrong on purpose
    (out / INDEX_NAME).write_text(json.dumps(doc))
    return out


def run_script(*args: str) -> tuple[int, dict | None, str]:
    r = subprocess.run([sys.executable, str(SCRIPT), *args, "--json"], capture_output=True, text=True)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else None, r.stderr


def test_script_check_then_apply_then_noop(pair: GeneratedPair, hybrid_without_mtp: Path) -> None:
    target = hybrid_without_mtp
    index_before = (target / INDEX_NAME).read_bytes()
    rc, res, _ = run_script("--source", str(pair.int4_dir), "--target", str(target), "--check")
    assert (
        rc == 0 and res["changed"] is True and res["added"] == len(pair.mtp_names) and res["copied"] is True
    )
    assert (target / INDEX_NAME).read_bytes() == index_before and not (target / ck.EXTRA_FILE).exists()

    rc, res, _ = run_script("--source", str(pair.int4_dir), "--target", str(target))
    assert rc == 0 and res["changed"] is True and res["copied"] is True and res["linked"] is True
    assert res["total_size_before"] == 12345
    wm = read_index(target / INDEX_NAME).weight_map
    assert {n for n in wm if n.startswith("mtp.")} == set(read_header(pair.int4_dir / ck.EXTRA_FILE).tensors)
    report = ck.verify_checkpoint(target, expect_mtp=True, expect_hybrid=True)
    assert report.ok, report.problems
    assert res["total_size_after"] == read_index(target / INDEX_NAME).total_size

    rc, res, _ = run_script("--source", str(pair.int4_dir), "--target", str(target))
    assert rc == 0 and res == {**res, "changed": False, "added": 0, "copied": False}


def test_names_come_from_extra_header_not_source_index(pair: GeneratedPair, tmp_path: Path) -> None:
    # source index lists a bogus mtp name; it must not be registered
    doc = json.loads((pair.int4_dir / INDEX_NAME).read_text())
    doc["weight_map"]["mtp.bogus.weight"] = ck.EXTRA_FILE
    (pair.int4_dir / INDEX_NAME).write_text(json.dumps(doc))
    target = tmp_path / "t"
    shutil.copytree(pair.int4_dir, target)
    res = ck.apply_mtp_patch(pair.int4_dir, target)
    wm = read_index(target / INDEX_NAME).weight_map
    assert "mtp.bogus.weight" not in wm
    assert res.added == len(pair.mtp_names) and res.copied is False
    assert ck.verify_checkpoint(target, expect_mtp=True).ok


def test_copy_when_hard_link_impossible(pair: GeneratedPair, hybrid_without_mtp: Path, monkeypatch) -> None:
    def no_link(*a, **k):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(ck.os, "link", no_link)
    res = ck.apply_mtp_patch(pair.int4_dir, hybrid_without_mtp)
    assert res.copied and not res.linked
    tgt = hybrid_without_mtp / ck.EXTRA_FILE
    assert tgt.read_bytes() == (pair.int4_dir / ck.EXTRA_FILE).read_bytes()
    assert tgt.stat().st_ino != (pair.int4_dir / ck.EXTRA_FILE).stat().st_ino
    assert not list(hybrid_without_mtp.glob(".*tmp*"))


def test_missing_extra_file_fails_clearly(pair: GeneratedPair, hybrid_without_mtp: Path) -> None:
    (pair.int4_dir / ck.EXTRA_FILE).unlink()
    rc, res, err = run_script("--source", str(pair.int4_dir), "--target", str(hybrid_without_mtp))
    assert rc == 1 and res is None
    assert "model_extra_tensors.safetensors" in err and "missing" in err


def test_script_main_plain_output(pair: GeneratedPair, hybrid_without_mtp: Path, capsys) -> None:
    assert (
        mtp_index_patch.main(["--source", str(pair.int4_dir), "--target", str(hybrid_without_mtp), "--check"])
        == 0
    )
    assert "would change" in capsys.readouterr().out


# ------------------------------------------------------------------ Ansible module


@pytest.fixture
def module(monkeypatch):
    """Import library/mtp_index_patch.py with scripts/ as ansible.module_utils (as ansible.cfg does)."""
    monkeypatch.setattr(
        ansible.module_utils, "__path__", [*ansible.module_utils.__path__, str(ROOT / "scripts")]
    )
    monkeypatch.syspath_prepend(str(ROOT / "library"))
    sys.modules.pop("mtp_index_patch_module", None)
    spec = importlib.util.spec_from_file_location(
        "mtp_index_patch_module", ROOT / "library" / "mtp_index_patch.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_module(mod, capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        mod.main()
    return json.loads(capsys.readouterr().out)


def test_module_check_mode_diff_apply_idempotent(
    module, pair: GeneratedPair, hybrid_without_mtp: Path, capsys
):
    target = hybrid_without_mtp
    index_before = (target / INDEX_NAME).read_bytes()
    res = run_module(
        module,
        capsys,
        source=str(pair.int4_dir),
        target=str(target),
        _ansible_check_mode=True,
        _ansible_diff=True,
    )
    assert res["changed"] is True and res["added"] == len(pair.mtp_names)
    assert (target / INDEX_NAME).read_bytes() == index_before
    entries = len(read_index(target / INDEX_NAME).weight_map)
    assert f"weight_map entries: {entries}" in res["diff"]["before"]
    assert f"weight_map entries: {entries + len(pair.mtp_names)}" in res["diff"]["after"]
    assert "total_size: 12345" in res["diff"]["before"]

    res = run_module(module, capsys, source=str(pair.int4_dir), target=str(target), _ansible_diff=True)
    assert res["changed"] is True and res["copied"] is True
    assert ck.verify_checkpoint(target, expect_mtp=True).ok

    res = run_module(module, capsys, source=str(pair.int4_dir), target=str(target), _ansible_diff=True)
    assert res["changed"] is False and "diff" not in res


def test_module_fails_on_missing_extra_file(module, pair: GeneratedPair, hybrid_without_mtp: Path, capsys):
    (pair.int4_dir / ck.EXTRA_FILE).unlink()
    res = run_module(module, capsys, source=str(pair.int4_dir), target=str(hybrid_without_mtp))
    assert res["failed"] is True and "MTP extra file missing" in res["msg"]


def test_module_documentation_is_valid_yaml(module) -> None:
    import yaml

    doc = yaml.safe_load(module.DOCUMENTATION)
    assert set(doc["options"]) == {"source", "target", "extra_file"}
    assert doc["options"]["extra_file"]["default"] == ck.EXTRA_FILE
    assert yaml.safe_load(module.EXAMPLES) and "total_size_after" in yaml.safe_load(module.RETURN)
