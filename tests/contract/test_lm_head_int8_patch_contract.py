"""Our INT8 LM head patch (patches/vllm-<version>/0002-int8-lm-head.patch) against the real vLLM.

Every test runs once per version (ids ``0.19.1``, ``0.20.0`` and ``0.26.0``; 0.20.0 and 0.26.0 are
the pure-Python part of their wheels in .cache/vllm-<version>-py, as in
test_inc_hybrid_patch_contract.py).

- The patch applies (git apply and patch -p1) to the pristine files it touches, on top of 0001; it
  holds only the call site: the module it imports is patches/src/sparkllm_lm_head_int8.py, which
  roles/vllm_build/files/apply_patches.sh (the image's patch step, run here) installs once where the
  call site imports it (patches/src/modules).
- lm_head_probe.py drives vLLM's own layers on the CPU platform (see its docstring) in four
  configurations, run concurrently:
  * patched, SPARKLLM_LM_HEAD_INT8=1 (CPU kernel: torch's _weight_int8pack_mm),
  * patched, SPARKLLM_LM_HEAD_INT8=1, the Triton kernel the CUDA path uses, run by Triton's
    interpreter (TRITON_INTERPRET=1; the interpreter's bf16 dot is wrong, so the kernel does its
    tile product in fp32 there and in bf16 on a GPU: the rest of the kernel is the same code),
  * patched, variable unset: must be byte-identical to the unpatched package,
  * unpatched, SPARKLLM_LM_HEAD_INT8=1: the head stays BF16 (the tests can fail without the patch).

Bounds (random N(0, 0.02) weights, N(0, 1) hidden states, vocabulary 1000 padded to 1024, 384
wide, 64 tokens): logits within 2 % of max |logit| of the fp32 product of the original weights
(per-row INT8 error is at most max|w_row| / 254 per weight; measured ~0.8 %, BF16 itself ~0.25 %),
and at least 60 of 64 greedy tokens equal to the fp32 reference (measured 64). Not exercised:
GPU speed or the kernel's bf16 tile product on real hardware (the load-time check in the patch
compares the kernel with the dequantized weight on the GPU before the BF16 weight is dropped).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.contract.vllm_targets import VERSIONS, VllmTarget, vllm_target

pytestmark = pytest.mark.vllm_contract

CONTRACT_DIR = Path(__file__).resolve().parent
ROOT = CONTRACT_DIR.parents[1]
# versions with vLLM's DFlash proposer (the dflash build variant is 0.26.0)
DFLASH_VERSIONS = {"0.20.0", "0.26.0"}
PATCH_NAME = "0002-int8-lm-head.patch"
UTILS_REL = Path("vllm/model_executor/model_loader/utils.py")
NEW_REL = Path("vllm/model_executor/layers/sparkllm_lm_head_int8.py")
SOURCE = ROOT / "patches" / "src" / "sparkllm_lm_head_int8.py"
APPLY = ROOT / "roles" / "vllm_build" / "files" / "apply_patches.sh"
LOG_RE = re.compile(r"sparkllm: lm_head INT8 \(per-row\), 1024x384 in CausalLM \(lm_head\), kernel (\w+), "
                    r"weight max abs err ([0-9.e+-]+) \(max \|w\| [0-9.e+-]+\), check logits max abs err "
                    r"([0-9.e+-]+) vs bfloat16, 0\.8 MiB -> 0\.4 MiB")
MAX_REL_ERR = 0.02
MIN_ARGMAX_AGREE = 60  # of 64


@pytest.fixture(scope="session", params=VERSIONS)
def lm_target(request, vllm_module) -> VllmTarget:
    return vllm_target(request.param, vllm_module)


def series(target: VllmTarget) -> list[Path]:
    names = [ln.strip() for ln in (target.patch_dir / "series").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    return [target.patch_dir / n for n in names]


def git(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)


@pytest.fixture(scope="session")
def lm_patched_parent(lm_target, tmp_path_factory) -> Path:
    """A copy of the pristine vllm package with the whole series applied by the image's own patch step
    (apply_patches.sh: the modules of patches/src first, then the series)."""
    parent = tmp_path_factory.mktemp(f"lm-head-site-{lm_target.version}")

    def copy(src, dst):
        if src.endswith(".so"):
            os.symlink(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(lm_target.package, parent / "vllm", copy_function=copy)
    applied = subprocess.run(["sh", str(APPLY), str(lm_target.patch_dir), str(parent), str(SOURCE.parent)],
                             capture_output=True, text=True, check=False)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert f"applied {len(series(lm_target))} patch(es)" in applied.stdout
    assert (parent / NEW_REL).read_bytes() == SOURCE.read_bytes()
    return parent


def run_probe(vllm_parent: Path | None, env_extra: dict[str, str], pristine: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARKLLM_LM_HEAD_INT8", "SPARKLLM_LM_HEAD_INT8_KERNEL", "TRITON_INTERPRET")}
    env.update(env_extra)
    if pristine:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, str(CONTRACT_DIR / "lm_head_probe.py")]
    if vllm_parent is not None:
        cmd += ["--vllm-parent", str(vllm_parent)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=900)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("LM_HEAD_PROBE_RESULT ")]
    assert proc.returncode == 0 and lines, (stdout[-3000:], stderr[-4000:])
    result = json.loads(lines[-1].split(" ", 1)[1])
    result["log"] = stdout + stderr
    return result


@pytest.fixture(scope="session")
def probes(lm_target, lm_patched_parent) -> dict[str, dict]:
    pristine_parent = None if lm_target.installed else lm_target.package.parent
    configs = {
        "int8_torch": (lm_patched_parent, {"SPARKLLM_LM_HEAD_INT8": "1"}, False),
        "int8_triton": (lm_patched_parent, {"SPARKLLM_LM_HEAD_INT8": "1",
                                            "SPARKLLM_LM_HEAD_INT8_KERNEL": "triton",
                                            "TRITON_INTERPRET": "1"}, False),
        "patched_off": (lm_patched_parent, {}, False),
        "unpatched_on": (pristine_parent, {"SPARKLLM_LM_HEAD_INT8": "1"}, True),
    }
    procs = {name: run_probe(*cfg) for name, cfg in configs.items()}
    try:
        return {name: finish(proc) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


# --- the patch applies ---------------------------------------------------------------------------

def test_patch_applies_to_pristine_files(lm_target, tmp_path):
    tree = tmp_path / "src"
    (tree / UTILS_REL).parent.mkdir(parents=True)
    shutil.copy2(lm_target.package.parent / UTILS_REL, tree / UTILS_REL)
    patch = lm_target.patch_dir / PATCH_NAME
    assert PATCH_NAME in [p.name for p in series(lm_target)]
    check = git("apply", "--check", "-v", str(patch), cwd=tree)
    assert check.returncode == 0, check.stderr
    assert git("apply", str(patch), cwd=tree).returncode == 0
    assert not (tree / NEW_REL).exists(), "the patch embeds the module again (carried once in patches/src)"
    assert "sparkllm_lm_head_int8.quantize_lm_heads(model)" in (tree / UTILS_REL).read_text()
    assert git("apply", "--check", "-R", str(patch), cwd=tree).returncode == 0
    assert not (lm_target.package / NEW_REL.relative_to("vllm")).exists(), "pristine vLLM has our file"


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patch_p1_works_in_site_packages_layout(lm_target, tmp_path):
    tree = tmp_path / "site-packages"
    (tree / UTILS_REL).parent.mkdir(parents=True)
    shutil.copy2(lm_target.package.parent / UTILS_REL, tree / UTILS_REL)
    proc = subprocess.run(["patch", "-p1", "-d", str(tree), "-i", str(lm_target.patch_dir / PATCH_NAME)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fuzz" not in proc.stdout.lower() and "offset" not in proc.stdout.lower()
    assert not (tree / NEW_REL).exists()


def test_the_call_site_imports_the_module_from_where_the_patch_step_installs_it(lm_patched_parent):
    """In the patched tree (modules installed by apply_patches.sh, then the series): the import the call
    site makes resolves to patches/src's file, under the real vllm package of this version."""
    probe = ("import importlib.util, sys; sys.path.insert(0, sys.argv[1]); "
             "spec = importlib.util.find_spec('vllm.model_executor.layers.sparkllm_lm_head_int8'); "
             "print(spec.origin)")
    out = subprocess.run([sys.executable, "-c", probe, str(lm_patched_parent)], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()) == lm_patched_parent / NEW_REL
    utils = (lm_patched_parent / UTILS_REL).read_text()
    assert "from vllm.model_executor.layers import sparkllm_lm_head_int8" in utils



@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_gpu_e2e_staging_installs_the_module_too(lm_target, tmp_path):
    """tests/gpu/e2e.py stages its patched vLLM itself (patch -p1 on a copy): it must install the carried
    module as well, or the GPU run's INT8 case would fail at import. Run on a stock tree holding the real
    files the series touches."""
    from tests.gpu import e2e
    stock = tmp_path / "stock"
    for patch in series(lm_target):
        for rel in re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M):
            (stock / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lm_target.parent / rel, stock / rel)
    dest, names = e2e.patched_vllm(tmp_path / "work", stock, lm_target.version)
    assert names == [p.name for p in series(lm_target)]
    assert (dest / NEW_REL).read_bytes() == SOURCE.read_bytes()
    assert "sparkllm_lm_head_int8.quantize_lm_heads(model)" in (dest / UTILS_REL).read_text()

# --- behaviour ------------------------------------------------------------------------------------

def test_probes_ran_the_intended_code(probes, lm_patched_parent, lm_target):
    for name in ("int8_torch", "int8_triton", "patched_off"):
        assert Path(probes[name]["loader_utils_file"]).resolve() == (lm_patched_parent / UTILS_REL).resolve()
    assert Path(probes["unpatched_on"]["loader_utils_file"]).resolve() == \
        (lm_target.package.parent / UTILS_REL).resolve()
    assert {p["vllm_version"] for p in probes.values()} == {lm_target.version}


@pytest.mark.parametrize("config,kernel", [("int8_torch", "torch"), ("int8_triton", "triton")])
def test_enabled_head_is_int8_and_bf16_weight_is_gone(probes, config, kernel):
    head = probes[config]["head"]
    assert head["method"] == "Int8LMHeadMethod"
    assert head["dtype"] == "torch.int8" and head["shape"] == [1024, 384]
    assert head["scale"] == ["torch.float32", [1024]]
    assert head["params"] == ["weight", "weight_scale"]
    assert head["old_weight_freed"] is True
    # int8 weight + one fp32 scale per row: about half of the BF16 bytes
    assert head["bytes_before"] == 1024 * 384 * 2
    assert head["bytes_after"] == 1024 * 384 + 1024 * 4
    logs = LOG_RE.findall(probes[config]["log"])
    # target, MTP drafter, EAGLE drafter (and, where vLLM has DFlash, the DFlash drafter) each load
    # and quantize their own copy; the tied head and the one with a NaN weight are left
    expected = 1 + len(probes[config]["drafters"])
    assert len(logs) == expected and {k for k, _, _ in logs} == {kernel}, probes[config]["log"][-3000:]


@pytest.mark.parametrize("config", ["int8_torch", "int8_triton"])
def test_enabled_logits_match_the_reference(probes, config):
    logits = probes[config]["logits"]
    assert logits["dtype"] == "torch.bfloat16" and logits["shape"] == [64, 1000]
    assert logits["max_rel_err"] < MAX_REL_ERR, logits
    assert logits["max_rel_err"] > logits["bf16_max_rel_err"], "suspiciously exact: is it still BF16?"
    assert logits["argmax_agree_fp32"] >= MIN_ARGMAX_AGREE, logits
    assert logits["top_tokens_equal_argmax"] is True


@pytest.mark.parametrize("config", ["int8_torch", "int8_triton"])
def test_embeddings_are_never_quantized(probes, config):
    result = probes[config]
    assert result["embedding"] == {"dtype": "torch.bfloat16", "method": "UnquantizedEmbeddingMethod",
                                   "unchanged": True}
    assert result["embedding_lookup_exact"] is True
    tied = result["tied"]
    assert tied["shares_embedding"] is True and tied["logits_exact"] is True
    assert tied["head_dtype"] == tied["embed_dtype"] == "torch.bfloat16"
    assert tied["method"] == "UnquantizedEmbeddingMethod"
    assert "its weight is shared with another module (tied embedding)" in result["log"]


@pytest.mark.parametrize("config", ["int8_torch", "int8_triton"])
def test_drafters_share_the_int8_head(probes, config, lm_target):
    """vLLM's own _maybe_share_lm_head: the MTP drafter takes the target's (INT8) head module;
    an EAGLE drafter whose own head is identical is recognised as identical after quantization;
    where vLLM has DFlash, a DFlash drafter without its own head (DFlashProposer's method) too."""
    kinds = ["mtp", "eagle_identical"]
    if lm_target.version in DFLASH_VERSIONS:
        kinds.append("dflash_no_head")
    assert sorted(probes[config]["drafters"]) == sorted(kinds)
    for kind in kinds:
        d = probes[config]["drafters"][kind]
        assert d == {"own_head_dtype_before_share": "torch.int8", "shares_target_head": True,
                     "logits_equal_target": True}, (kind, d)


@pytest.mark.parametrize("config", ["int8_torch", "int8_triton"])
def test_a_head_it_cannot_quantize_stays_as_loaded(probes, config):
    """Fallback: non-finite weights -> a warning naming the reason, the BF16 head untouched."""
    assert probes[config]["non_finite"] == {"head_dtype": "torch.bfloat16",
                                            "method": "UnquantizedEmbeddingMethod",
                                            "weight_unchanged": True}
    assert re.search(r"sparkllm: lm_head INT8 unavailable for CausalLM \(lm_head\): ValueError: "
                     r"non-finite weights in rows 0\.\.1023; keeping torch\.bfloat16", probes[config]["log"])


def test_triton_kernel_agrees_with_the_cpu_kernel(probes):
    a, b = probes["int8_torch"]["logits"], probes["int8_triton"]["logits"]
    assert a["argmax_agree_fp32"] == b["argmax_agree_fp32"]
    assert abs(a["max_abs_err"] - b["max_abs_err"]) < 0.01


def test_disabled_is_byte_identical_to_unpatched(probes):
    off = probes["patched_off"]
    assert off["head"]["method"] == "UnquantizedEmbeddingMethod"
    assert off["head"]["dtype"] == "torch.bfloat16" and off["head"]["old_weight_freed"] is False
    assert "sparkllm:" not in off["log"]
    unpatched = probes["unpatched_on"]
    assert off["logits"]["sha256"] == unpatched["logits"]["sha256"]
    assert off["logits"]["max_rel_err"] == unpatched["logits"]["bf16_max_rel_err"]
    for kind in ("mtp", "eagle_identical"):
        assert off["drafters"][kind]["own_head_dtype_before_share"] == "torch.bfloat16"


def test_unpatched_ignores_the_variable(probes):
    """Without the patch the same probe sees a BF16 head: the INT8 assertions above can fail."""
    unpatched = probes["unpatched_on"]
    assert unpatched["head"]["dtype"] == "torch.bfloat16"
    assert unpatched["head"]["method"] == "UnquantizedEmbeddingMethod"
    assert unpatched["head"]["bytes_after"] == unpatched["head"]["bytes_before"]
    assert "sparkllm: lm_head INT8" not in unpatched["log"]
