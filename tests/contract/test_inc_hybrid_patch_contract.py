"""Our INC hybrid patches (patches/vllm-<version>/) against the real vLLM they are written for.

Every test runs once per version (ids ``0.19.1``, ``0.20.0`` and ``0.26.0``):
- 0.19.1: the vLLM installed in .venv-vllm.
- 0.20.0, 0.26.0: the pure-Python part of its wheel (.cache/vllm-<version>-py, fetched by
  setup_vllm_env.sh), run by the same interpreter (torch 2.10; 0.26.0 is built for a newer
  torch, but the config, linear-layer and loader code used here imports and runs on 2.10) put
  first on sys.path, without compiled extensions (vllm._C is absent; nothing here needs it).
  Skipped when it is missing. 0.26.0's INC config lives in quantization/inc/inc.py.

- The series applies to that version's pristine inc.py (git apply and patch -p1, as
  patches/README.md says).
- A copy of that vllm package (compiled extensions symlinked, never modified) is patched in a
  temporary directory; inc_probe.py runs vLLM's real ModelConfig/VllmConfig (which build the INC
  config and call maybe_update_config themselves) with it first on sys.path in a subprocess, on a
  generated hybrid checkpoint: FP8 method for the shared expert, with weight and weight_scale_inv
  parameters that the checkpoint's tensors load into byte for byte, GPTQ-Marlin for INT4 layers,
  the FP8 layer count right.
- The same probe on the unpatched package picks the unquantized method for the shared expert and
  finds no parameter for the weight_scale_inv tensors: the tests can fail.

Not exercised (no GPU here): kernels and forward passes. In 0.20.0 Fp8LinearMethod picks its GEMM
kernel while creating weights and has none for the CPU platform; inc_probe.py records the inputs
of that choice (block group shapes) and steps past the error, see its docstring.
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

from tests.contract.hybrid_checkpoint import write_hybrid
from tests.contract.vllm_targets import VERSIONS, VllmTarget, vllm_target

pytestmark = pytest.mark.vllm_contract

CONTRACT_DIR = Path(__file__).resolve().parent
ROOT = CONTRACT_DIR.parents[1]

PATCH_NAME = "0001-inc-hybrid-fp8.patch"
INC_REL = Path("vllm/model_executor/layers/quantization/inc.py")
# 0.26.0 moved the INC config into a package: quantization/inc/inc.py
INC_REL_BY_VERSION = {"0.26.0": Path("vllm/model_executor/layers/quantization/inc/inc.py")}
# The method INC gives INT4 linear layers on CUDA: 0.26.0 wraps AutoGPTQLinearMethod (its GPTQ
# Marlin method; 0.26.0 has no other GPTQ linear method) in its scheme wrapper.
INT4_METHOD = {"0.26.0": "INCLinearMethod(AutoGPTQLinearMethod)"}
SHARED = "language_model.model.layers.0.mlp.shared_expert"
LOG_LINE = "INC: hybrid checkpoint: found {n} FP8 layers (F8_E4M3, {b}x{b} block scales)"


class Target(VllmTarget):
    """One vLLM version, with where its INC code and INT4 method are."""

    @property
    def inc_rel(self) -> Path:
        return INC_REL_BY_VERSION.get(self.version, INC_REL)

    @property
    def int4_method(self) -> str:
        return INT4_METHOD.get(self.version, "GPTQMarlinLinearMethod")

    @property
    def patch(self) -> Path:
        return self.patch_dir / PATCH_NAME


@pytest.fixture(scope="session", params=VERSIONS)
def target(request, vllm_module) -> Target:
    return vllm_target(request.param, vllm_module, Target)


@pytest.fixture(scope="session")
def pristine_inc_digest(target):
    path = target.parent / target.inc_rel
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    yield digest
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{path} was modified"


def series_patches(target: Target) -> list[Path]:
    names = [ln.strip() for ln in (target.patch_dir / "series").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    return [target.patch_dir / n for n in names]


def pristine_tree(target: Target, dest: Path) -> Path:
    """inc.py and every other existing file a patch of the series changes (later patches)."""
    rels = {target.inc_rel}
    for patch in series_patches(target):
        rels.update(Path(ln[len("--- a/"):].split("\t")[0]) for ln in patch.read_text().splitlines()
                    if ln.startswith("--- a/"))
    for rel in rels:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(target.parent / rel, dest / rel)
    return dest


def git(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)


@pytest.fixture(scope="session")
def patched_parent(target, pristine_inc_digest, tmp_path_factory) -> Path:
    """A copy of the pristine vllm package with the series applied (site-packages layout)."""
    parent = tmp_path_factory.mktemp(f"patched-site-{target.version}")

    def copy(src, dst):
        if src.endswith(".so"):
            os.symlink(src, dst)  # 1.1 GB of extensions: link, do not copy (never written to)
        else:
            shutil.copy2(src, dst)

    # __pycache__ is copied with its sources (copy2 keeps mtimes, so the bytecode stays valid and
    # only patched files are recompiled: a cold import of vLLM compiles for ~30 s).
    shutil.copytree(target.package, parent / "vllm", copy_function=copy)
    for patch in series_patches(target):
        check = git("apply", "--check", str(patch), cwd=parent)
        assert check.returncode == 0, f"{patch.name} does not apply: {check.stderr}"
        applied = git("apply", str(patch), cwd=parent)
        assert applied.returncode == 0, applied.stderr
    return parent


def start_probe(checkpoints: list[Path], vllm_parent: Path | None, pristine: bool) -> subprocess.Popen:
    """Start inc_probe.py for several checkpoints (one process: importing vLLM takes ~30 s here)."""
    cmd = [sys.executable, str(CONTRACT_DIR / "inc_probe.py"), *map(str, checkpoints)]
    env = dict(os.environ)
    if pristine:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # write nothing into .venv-vllm or .cache
    if vllm_parent is not None:
        cmd += ["--vllm-parent", str(vllm_parent)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish_probe(proc: subprocess.Popen) -> list[dict]:
    stdout, stderr = proc.communicate(timeout=900)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("INC_PROBE_RESULT ")]
    assert proc.returncode == 0 and lines, (stdout[-2000:], stderr[-4000:])
    report = json.loads(lines[-1].split(" ", 1)[1])
    for result in report["results"]:
        result["inc_file"] = report["inc_file"]
        result["vllm_version"] = report["vllm_version"]
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
def probe_results(target, patched_parent, checkpoints, pristine_inc_digest):
    """Patched copy on every checkpoint and the unpatched package on hybrid128, run concurrently."""
    names = list(checkpoints)
    patched = start_probe([checkpoints[n].path for n in names], patched_parent, pristine=False)
    unpatched = start_probe([checkpoints["hybrid128"].path], target.probe_parent, pristine=True)
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

def test_series_applies_to_pristine_inc_with_git(target, pristine_inc_digest, tmp_path):
    tree = pristine_tree(target, tmp_path / "src")
    for patch in series_patches(target):
        check = git("apply", "--check", "-v", str(patch), cwd=tree)
        assert check.returncode == 0, check.stderr
        assert git("apply", str(patch), cwd=tree).returncode == 0
    # applied exactly: it reverses cleanly, and the file changed
    assert git("apply", "--check", "-R", str(target.patch), cwd=tree).returncode == 0
    assert (tree / target.inc_rel).read_bytes() != (target.parent / target.inc_rel).read_bytes()


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patch_p1_works_in_site_packages_layout(target, pristine_inc_digest, tmp_path):
    """patches/README.md documents `patch -p1 -d <site-packages>` for an installed vLLM."""
    tree = pristine_tree(target, tmp_path / "site-packages")
    proc = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(tree), "-i", str(target.patch)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout and "offset" not in proc.stdout.lower()
    assert "fuzz" not in proc.stdout.lower()


def test_other_versions_patches_do_not_apply(target, pristine_inc_digest, tmp_path):
    """Each version needs its own patch: the other version's does not apply (git apply)."""
    tree = pristine_tree(target, tmp_path / "src")
    for version in VERSIONS:
        if version == target.version:
            continue
        other = ROOT / "patches" / f"vllm-{version}" / PATCH_NAME
        assert git("apply", "--check", str(other), cwd=tree).returncode != 0, other


def test_patched_copy_is_used_and_pristine_file_untouched(patched_parent, target):
    patched = (patched_parent / target.inc_rel).read_text()
    assert "def maybe_update_config" in patched and "Fp8Config" in patched
    assert "def maybe_update_config" not in (target.parent / target.inc_rel).read_text()


# --- what the real vLLM code does with it --------------------------------------------------------

@pytest.fixture(scope="session")
def patched_result(patched_results):
    return patched_results["hybrid128"]


@pytest.fixture(scope="session")
def unpatched_result(probe_results):
    return probe_results[1]


def test_probe_ran_the_intended_code(patched_result, unpatched_result, patched_parent, target):
    assert Path(patched_result["inc_file"]).resolve() == (patched_parent / target.inc_rel).resolve()
    assert Path(unpatched_result["inc_file"]).resolve() == (target.parent / target.inc_rel).resolve()
    assert patched_result["vllm_version"] == unpatched_result["vllm_version"] == target.version


def test_patched_finds_exactly_the_fp8_layers(patched_result, hybrid128):
    assert len(hybrid128.fp8_layers) == 4 * 3
    assert patched_result["fp8_layer_count"] == len(hybrid128.fp8_layers)
    assert patched_result["fp8_block"] == [128, 128]
    assert patched_result["fp8_dynamic"] is True
    # the GPU end-to-end script greps "found (\\d+) FP8 layers" in the server log
    assert LOG_LINE.format(n=len(hybrid128.fp8_layers), b=128) in patched_result["log"]


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


def test_patched_int4_layers_keep_gptq_marlin(patched_result, target):
    assert patched_result["int4_attention_fp8_route"] == "NoneType"
    assert patched_result["int4_attention_method"] == target.int4_method
    assert patched_result["int4_expert_fp8_route"] == "NoneType"
    assert patched_result["int4_expert_linear_method"] == target.int4_method
    assert patched_result["shared_expert_gate_method"] == "UnquantizedLinearMethod"


def test_unpatched_treats_fp8_shared_expert_as_unquantized(unpatched_result, target):
    """The bug the patch fixes, shown by the same probe: proves the patched assertions can fail."""
    assert unpatched_result["fp8_layer_count"] == 0
    assert unpatched_result["shared_gate_up"]["method"] == "UnquantizedLinearMethod"
    assert unpatched_result["shared_gate_up"]["params"]["weight"][0] == "torch.bfloat16"
    assert "weight_scale_inv" not in unpatched_result["shared_gate_up"]["params"]
    assert unpatched_result["shared_down"]["method"] == "UnquantizedLinearMethod"
    assert unpatched_result["int4_attention_method"] == target.int4_method
    assert "FP8 layers" not in unpatched_result["log"]
    # the loader would skip every block scale: no parameter of that name
    assert sorted(unpatched_result["shared_load"]["not_found"]) == sorted(
        [f"{SHARED}.down_proj.weight_scale_inv"] + [f"{SHARED}.gate_up_proj.weight_scale_inv"] * 2)


@pytest.mark.parametrize("block", [64, 32])
def test_patched_infers_other_block_sizes(patched_results, checkpoints, block):
    hybrid = checkpoints[f"hybrid{block}"]
    result = patched_results[f"hybrid{block}"]
    assert result["fp8_block"] == [block, block]
    assert result["fp8_layer_count"] == len(hybrid.fp8_layers) == 2 * 3
    down_scale = hybrid.shapes["model.language_model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv"]
    assert result["shared_down"]["method"] == "Fp8LinearMethod"
    assert result["shared_down"]["params"]["weight_scale_inv"] == ["torch.float32", down_scale]


def test_patched_leaves_plain_int4_checkpoints_alone(patched_results, checkpoints, target):
    assert checkpoints["plain"].fp8_layers == []
    result = patched_results["plain"]
    assert result["fp8_layer_count"] == 0
    assert result["fp8_block"] is None
    assert result["shared_gate_up"]["method"] == "UnquantizedLinearMethod"
    assert result["int4_expert_linear_method"] == target.int4_method


@pytest.mark.parametrize("name", ["hybrid128", "hybrid64", "hybrid32", "plain"])
def test_patched_loads_every_shared_expert_tensor(patched_results, checkpoints, name):
    """Every shared-expert tensor of the checkpoint has a parameter and lands in it unchanged."""
    load = patched_results[name]["shared_load"]
    expected = sorted(n for n in checkpoints[name].shapes
                      if n.startswith("model.language_model.layers.0.mlp.shared_expert."))
    assert load["checkpoint_tensors"] == expected
    assert len(expected) == (6 if checkpoints[name].fp8_layers else 3)
    assert load["not_found"] == [] and load["errors"] == {} and load["mismatched"] == []
    assert load["loaded"] == expected


def test_patched_fp8_kernel_is_asked_for_block_quant(patched_result, target):
    """0.20.0 and 0.26.0 choose the FP8 GEMM kernel in create_weights: it is asked for 128x128 weight blocks
    and 1x128 dynamic activation groups, for both shared-expert layers. (Which kernel: CUDA only.)"""
    if target.version == "0.19.1":
        pytest.skip("0.19.1 picks the block-FP8 GEMM (W8A8BlockFp8LinearOp) outside init_fp8_linear_kernel")
    calls = patched_result["fp8_kernel_calls"]
    assert [c["weight_shape"] for c in calls] == [[256, 256], [256, 128]]
    for call in calls:
        assert call["weight_group"] == [128, 128]
        assert call["activation_group"] == [1, 128]
