"""patches/vllm-0.19.1/0001-inc-hybrid-fp8.patch against the installed vLLM 0.19.1.

- The patch applies to the installed inc.py (git apply and patch -p1, as patches/README.md says).
- A copy of the installed vllm package (compiled extensions symlinked, never modified) is patched
  in a temporary directory; inc_probe.py runs vLLM's real INC config with it (put first on
  sys.path in a subprocess) on a generated hybrid checkpoint: FP8 method for the shared expert,
  GPTQ-Marlin for INT4 layers, the FP8 layer count right.
- The same probe on the unpatched installed package picks the unquantized method for the shared
  expert: the test can fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hybrid_checkpoint import write_hybrid

pytestmark = pytest.mark.vllm_contract

CONTRACT_DIR = Path(__file__).resolve().parent
ROOT = CONTRACT_DIR.parents[1]

PATCH_DIR = ROOT / "patches" / "vllm-0.19.1"
PATCH = PATCH_DIR / "0001-inc-hybrid-fp8.patch"
INC_REL = Path("vllm/model_executor/layers/quantization/inc.py")
SHARED = "language_model.model.layers.0.mlp.shared_expert"


@pytest.fixture(scope="session")
def installed_vllm(vllm_module) -> Path:
    return Path(vllm_module.__file__).resolve().parent


@pytest.fixture(scope="session")
def installed_inc_digest(installed_vllm):
    path = installed_vllm.parent / INC_REL
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    yield digest
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, "the installed inc.py was modified"


def series_patches() -> list[Path]:
    names = [ln.strip() for ln in (PATCH_DIR / "series").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    return [PATCH_DIR / n for n in names]


def pristine_tree(installed_vllm: Path, dest: Path) -> Path:
    (dest / INC_REL).parent.mkdir(parents=True)
    shutil.copy2(installed_vllm.parent / INC_REL, dest / INC_REL)
    return dest


def git(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)


@pytest.fixture(scope="session")
def patched_parent(installed_vllm, installed_inc_digest, tmp_path_factory) -> Path:
    """A copy of the installed vllm package with the series applied (site-packages layout)."""
    parent = tmp_path_factory.mktemp("patched-site")

    def copy(src, dst):
        if src.endswith(".so"):
            os.symlink(src, dst)  # 1.1 GB of extensions: link, do not copy (never written to)
        else:
            shutil.copy2(src, dst)

    # __pycache__ is copied with its sources (copy2 keeps mtimes, so the bytecode stays valid and
    # only patched files are recompiled: a cold import of vLLM compiles for ~30 s).
    shutil.copytree(installed_vllm, parent / "vllm", copy_function=copy)
    for patch in series_patches():
        check = git("apply", "--check", str(patch), cwd=parent)
        assert check.returncode == 0, f"{patch.name} does not apply: {check.stderr}"
        applied = git("apply", str(patch), cwd=parent)
        assert applied.returncode == 0, applied.stderr
    return parent


def start_probe(checkpoints: list[Path], vllm_parent: Path | None) -> subprocess.Popen:
    """Start inc_probe.py for several checkpoints (one process: importing vLLM takes ~30 s here)."""
    cmd = [sys.executable, str(CONTRACT_DIR / "inc_probe.py"), *map(str, checkpoints)]
    env = dict(os.environ)
    if vllm_parent is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # write nothing into .venv-vllm
    else:
        cmd += ["--vllm-parent", str(vllm_parent)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish_probe(proc: subprocess.Popen) -> list[dict]:
    stdout, stderr = proc.communicate(timeout=900)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("INC_PROBE_RESULT ")]
    assert proc.returncode == 0 and lines, (stdout[-2000:], stderr[-4000:])
    report = json.loads(lines[-1].split(" ", 1)[1])
    for result in report["results"]:
        result["inc_file"] = report["inc_file"]
        result["log"] = stdout + stderr
    return report["results"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("checkpoints")
    return {
        "hybrid128": write_hybrid(base / "hybrid128", block=128),
        "hybrid64": write_hybrid(base / "hybrid64", block=64, layers=2),
        "hybrid32": write_hybrid(base / "hybrid32", block=32, layers=2),
        "plain": write_hybrid(base / "plain", fp8_shared=False, layers=2),
    }


@pytest.fixture(scope="session")
def hybrid128(checkpoints):
    return checkpoints["hybrid128"]


@pytest.fixture(scope="session")
def probe_results(patched_parent, checkpoints, installed_inc_digest):
    """Patched copy on every checkpoint and the installed (unpatched) vLLM on hybrid128, run
    concurrently."""
    names = list(checkpoints)
    patched = start_probe([checkpoints[n].path for n in names], patched_parent)
    unpatched = start_probe([checkpoints["hybrid128"].path], None)
    try:
        patched_results = dict(zip(names, finish_probe(patched), strict=True))
        unpatched_result = finish_probe(unpatched)[0]
    finally:
        for proc in (patched, unpatched):
            if proc.poll() is None:
                proc.kill()
    return patched_results, unpatched_result


@pytest.fixture(scope="session")
def patched_results(probe_results):
    return probe_results[0]


# --- the patch applies --------------------------------------------------------------------------

def test_series_applies_to_pristine_inc_with_git(installed_vllm, installed_inc_digest, tmp_path):
    tree = pristine_tree(installed_vllm, tmp_path / "src")
    for patch in series_patches():
        check = git("apply", "--check", "-v", str(patch), cwd=tree)
        assert check.returncode == 0, check.stderr
        assert git("apply", str(patch), cwd=tree).returncode == 0
    # applied exactly: it reverses cleanly, and the file changed
    assert git("apply", "--check", "-R", str(PATCH), cwd=tree).returncode == 0
    assert (tree / INC_REL).read_bytes() != (installed_vllm.parent / INC_REL).read_bytes()


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patch_p1_works_in_site_packages_layout(installed_vllm, installed_inc_digest, tmp_path):
    """patches/README.md documents `patch -p1 -d <site-packages>` for an installed vLLM."""
    tree = pristine_tree(installed_vllm, tmp_path / "site-packages")
    proc = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(tree), "-i", str(PATCH)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout and "offset" not in proc.stdout.lower()


def test_patched_copy_is_used_and_installed_file_untouched(patched_parent, installed_vllm):
    patched = (patched_parent / INC_REL).read_text()
    assert "def maybe_update_config" in patched and "Fp8Config" in patched
    assert "def maybe_update_config" not in (installed_vllm.parent / INC_REL).read_text()


# --- what the real vLLM code does with it --------------------------------------------------------

@pytest.fixture(scope="session")
def patched_result(patched_results):
    return patched_results["hybrid128"]


@pytest.fixture(scope="session")
def unpatched_result(probe_results):
    return probe_results[1]


def test_probe_ran_the_intended_code(patched_result, unpatched_result, patched_parent, installed_vllm):
    assert Path(patched_result["inc_file"]).resolve() == (patched_parent / INC_REL).resolve()
    assert Path(unpatched_result["inc_file"]).resolve() == (installed_vllm.parent / INC_REL).resolve()


def test_patched_finds_exactly_the_fp8_layers(patched_result, hybrid128):
    assert len(hybrid128.fp8_layers) == 4 * 3
    assert patched_result["fp8_layer_count"] == len(hybrid128.fp8_layers)
    assert patched_result["fp8_block"] == [128, 128]
    assert patched_result["fp8_dynamic"] is True
    assert f"found {len(hybrid128.fp8_layers)} FP8 layers" in patched_result["log"]


def test_patched_shared_expert_uses_block_fp8(patched_result, hybrid128):
    lm = "model.language_model.layers.0.mlp.shared_expert"
    gate_scale = hybrid128.shapes[f"{lm}.gate_proj.weight_scale_inv"]
    up_scale = hybrid128.shapes[f"{lm}.up_proj.weight_scale_inv"]
    down_scale = hybrid128.shapes[f"{lm}.down_proj.weight_scale_inv"]

    gate_up = patched_result["shared_gate_up"]
    assert gate_up["method"] == "Fp8LinearMethod"
    assert gate_up["params"]["weight"][0] == "torch.float8_e4m3fn"
    # the fused layer holds gate and up stacked: their block scales stack the same way
    stacked = [gate_scale[0] + up_scale[0], gate_scale[1]]
    assert gate_up["params"]["weight_scale_inv"] == ["torch.float32", stacked]
    down = patched_result["shared_down"]
    assert down["method"] == "Fp8LinearMethod"
    assert down["params"]["weight"] == ["torch.float8_e4m3fn", hybrid128.shapes[f"{lm}.down_proj.weight"]]
    assert down["params"]["weight_scale_inv"] == ["torch.float32", down_scale]


def test_patched_int4_layers_keep_gptq_marlin(patched_result):
    assert patched_result["int4_attention_fp8_route"] == "NoneType"
    assert patched_result["int4_attention_method"] == "GPTQMarlinLinearMethod"
    assert patched_result["int4_expert_fp8_route"] == "NoneType"
    assert patched_result["int4_expert_linear_method"] == "GPTQMarlinLinearMethod"
    assert patched_result["shared_expert_gate_method"] == "UnquantizedLinearMethod"


def test_unpatched_0_19_1_treats_fp8_shared_expert_as_unquantized(unpatched_result):
    """The bug the patch fixes, shown by the same probe: proves the patched assertions can fail."""
    assert unpatched_result["fp8_layer_count"] == 0
    assert unpatched_result["shared_gate_up"]["method"] == "UnquantizedLinearMethod"
    assert unpatched_result["shared_gate_up"]["params"]["weight"][0] == "torch.bfloat16"
    assert "weight_scale_inv" not in unpatched_result["shared_gate_up"]["params"]
    assert unpatched_result["shared_down"]["method"] == "UnquantizedLinearMethod"
    assert unpatched_result["int4_attention_method"] == "GPTQMarlinLinearMethod"


@pytest.mark.parametrize("block", [64, 32])
def test_patched_infers_other_block_sizes(patched_results, checkpoints, block):
    hybrid = checkpoints[f"hybrid{block}"]
    result = patched_results[f"hybrid{block}"]
    assert result["fp8_block"] == [block, block]
    assert result["fp8_layer_count"] == len(hybrid.fp8_layers) == 2 * 3
    down_scale = hybrid.shapes["model.language_model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv"]
    assert result["shared_down"]["method"] == "Fp8LinearMethod"
    assert result["shared_down"]["params"]["weight_scale_inv"] == ["torch.float32", down_scale]


def test_patched_leaves_plain_int4_checkpoints_alone(patched_results, checkpoints):
    assert checkpoints["plain"].fp8_layers == []
    result = patched_results["plain"]
    assert result["fp8_layer_count"] == 0
    assert result["fp8_block"] is None
    assert result["shared_gate_up"]["method"] == "UnquantizedLinearMethod"
    assert result["int4_expert_linear_method"] == "GPTQMarlinLinearMethod"
