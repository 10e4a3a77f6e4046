"""The image build checked against each variant's REAL vLLM release (its pinned sdist, cached).

- every path the Dockerfile's build stage reads from the source tree exists in that release;
- setup.py's third-party imports are installed by the build-requirements step (or by the base stage: torch);
- the variant's recorded ``gpu_code.source`` is what that release's own CMake selection (run in ``cmake -P``)
  makes for ``vllm_build_cuda_arch_list``, with the variant's build patches applied to a copy of the source;
- the recorded ``gpu_code.wheel`` agrees with the wheel listing (data/wheel_archs.json, cuobjdump of the
  pinned aarch64 wheels); the install decision (source|wheel) follows from those two;
- the post-build judge (filter_plugins/spark_gpu_code.py) fails a blanket sm_121 fed a 0.26.0-like listing.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from sparkllm.lock import sources as vllm_sources

from tests.contract import vllm_cmake_archs as arch

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
from spark_gpu_code import spark_gpu_code_judge  # noqa: E402

VARIANTS = yaml.safe_load((ROOT / "group_vars/all/methods.yml").read_text())["spark_vllm_variants"]
DEFAULTS = yaml.safe_load((ROOT / "roles/vllm_build/defaults/main.yml").read_text())
ARCH_LIST = DEFAULTS["vllm_build_cuda_arch_list"]
WHEELS = json.loads((ROOT / "tests/contract/data/wheel_archs.json").read_text())
DOCKERFILE = (ROOT / "templates/Dockerfile.j2").read_text()
BUILD_BLOCK = DOCKERFILE.split("{% block build %}", 1)[1].split("{% endblock %}", 1)[0]
SOURCE_MODE = BUILD_BLOCK.split("{% else %}\n# install: wheel", 1)[0]
MARLIN_HOT = ("Marlin dense INT4, fp16 out", "Marlin dense INT4, bf16 out", "Marlin MoE INT4")
EVERY_LIB = "MoE routing kernels"  # CUDA_ARCHS: the kernels every _C* library carries
IDS = sorted(VARIANTS)


def _cmake() -> str:
    cm = arch.find_cmake()
    if not cm:
        pytest.fail("no cmake: run tests/contract/setup_vllm_env.sh (it installs cmake from PyPI)")
    return cm


@cache
def _flags() -> str:
    import torch

    return arch.torch_gencode_flags(_cmake(), Path(torch.__file__).parent / "share" / "cmake", ARCH_LIST)


@cache
def _table(version: str, patches: tuple[str, ...]) -> dict:
    src = vllm_sources.source_tree(version)
    if patches:
        digest = hashlib.sha256(b"".join(Path(p).read_bytes() for p in patches)).hexdigest()[:16]
        tmp = ROOT / ".cache" / "vllm-src-patched" / f"{version}-{digest}"  # stable name: reruns reuse it
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(src, tmp)
        for p in patches:
            res = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(p)], cwd=tmp,
                                 capture_output=True, text=True, check=False)
            assert res.returncode == 0, f"{p.name} does not apply to vLLM {version}: {res.stdout}{res.stderr}"
        src = tmp
    return arch.family_table(arch.run_selection(_cmake(), src, _flags()))


def _patches(conf: dict) -> tuple[Path, ...]:
    return tuple(ROOT / "patches" / f"vllm-{conf['version']}" / p for p in conf.get("build_patches", []))


def _sass(gb10: str) -> set[str]:
    return set(re.findall(r"sm_\d+[af]?", gb10)) if gb10.startswith("SASS") else set()


def _listing(libs: dict) -> str:
    """An arch-check listing (cuobjdump --list-elf + marlin counts, as roles/vllm_build) of a wheel."""
    out = []
    for path, lib in libs.items():
        if not re.fullmatch(r"(_C|_moe_C|_vllm_fa2_C).*\.so", path.rsplit("/", 1)[-1]):
            continue  # what the check lists (roles/vllm_build vllm_build_check_arch_cmd)
        out.append(f"== /opt/venv/lib/python3.12/site-packages/{path}")
        out += [f"ELF file {i}: x.{a}.cubin" for i, a in enumerate(sorted(lib["sass"]), 1)]
        if lib.get("marlin_sm12x_sass", 0) or lib.get("marlin_ptx_only_on_sm12x", 0):
            out.append(f"marlin: sm12x-sass={lib['marlin_sm12x_sass']} ptx={lib['marlin_ptx_only_on_sm12x']}")
        out.append("ptx: " + " ".join(sorted(lib.get("ptx", {}))))
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("variant", IDS)
def test_every_source_path_the_build_stage_uses_exists_in_the_release(variant):
    conf = VARIANTS[variant]
    src = vllm_sources.source_tree(conf["version"])
    # paths relative to the vLLM checkout (our own files are copied to absolute paths such as /opt/sparkllm)
    used = [*conf["build_requirements"], *(p for p in re.findall(r"python3 (\S+\.py)", SOURCE_MODE)
                                           if not p.startswith("/")),
            "CMakeLists.txt", "cmake/utils.cmake", "setup.py"]
    assert "use_existing_torch.py" in used
    missing = [p for p in used if not (src / p).is_file()]
    assert missing == [], f"vLLM {conf['version']} has no {missing} (the Dockerfile's build stage reads them)"


def _requirements(path: Path, seen: set[Path]) -> set[str]:
    names = set()
    seen.add(path)
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            inc = (path.parent / line[2:].strip()).resolve()
            if inc not in seen:
                names |= _requirements(inc, seen)
        elif line and not line.startswith("-"):
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


@pytest.mark.parametrize("variant", IDS)
def test_setup_py_imports_are_installed_by_the_build_requirements_step(variant):
    conf = VARIANTS[variant]
    src = vllm_sources.source_tree(conf["version"])
    tree = ast.parse((src / "setup.py").read_text())
    mods = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
            for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    third = {m for m in mods if m not in sys.stdlib_module_names}
    provided = {"torch"}  # the base stage's torch (use_existing_torch.py drops vLLM's pin)
    for r in conf["build_requirements"]:
        provided |= _requirements(src / r, set())
    unmet = sorted(m for m in third if m.lower().replace("_", "-") not in provided)
    assert unmet == [], (f"vLLM {conf['version']} setup.py imports {unmet}; "
                         f"{conf['build_requirements']} do not install it")


def test_the_requirements_check_catches_the_019_path_used_for_026():
    src = vllm_sources.source_tree("0.26.0")
    assert not (src / "requirements/build.txt").exists()
    old = vllm_sources.source_tree("0.19.1") / "requirements/build.txt"
    assert "setuptools-rust" not in _requirements(old, set())  # so 0.26.0's setup.py would fail with it


@pytest.mark.parametrize("variant", IDS)
def test_recorded_source_gpu_code_is_what_the_release_cmake_makes(variant):
    conf = VARIANTS[variant]
    table = _table(conf["version"], _patches(conf))
    rec = conf["gpu_code"]["source"]
    assert rec["sass"] in _sass(next(v["gb10"] for k, v in table.items() if k.startswith(EVERY_LIB))), table
    hot_ptx = [k for k, v in table.items() if k.startswith(MARLIN_HOT) and not _sass(v["gb10"])]
    assert bool(hot_ptx) == rec["marlin_ptx_only_accepted"], (hot_ptx, rec)


def test_0191_marlin_is_ptx_only_without_the_build_patch_and_sass_with_it():
    plain = _table("0.19.1", ())
    patched = _table("0.19.1", _patches(VARIANTS["v0_19_1"]))
    for fam in MARLIN_HOT:
        (k,) = [k for k in plain if k.startswith(fam)]
        assert plain[k]["gb10"].startswith("PTX only"), plain[k]
        assert _sass(patched[k]["gb10"]) == {VARIANTS["v0_19_1"]["gpu_code"]["source"]["sass"]}, patched[k]
    rt = next(k for k in plain if k.startswith(EVERY_LIB))
    assert plain[rt]["archs"] == "12.1a"  # CUDA 13's supported list reaches 12.1 in 0.19.1


def test_0260_cmake_caps_cuda13_at_120():
    table = _table("0.26.0", ())
    rt = next(k for k in table if k.startswith(EVERY_LIB))
    assert table[rt]["archs"] == "12.0" and "sm_121" not in table[rt]["gb10"]


@pytest.mark.parametrize("variant", IDS)
def test_recorded_wheel_gpu_code_agrees_with_the_wheel_listing(variant):
    conf = VARIANTS[variant]
    w = WHEELS[conf["version"]]
    assert w["sha256"] == conf["wheel"]["sha256"] and conf["wheel"]["url"].endswith(w["filename"])
    judged = spark_gpu_code_judge(_listing(w["libraries"]), conf["gpu_code"]["wheel"])
    assert judged["problems"] == [], judged
    # the recorded SASS is in the wheel, and nothing newer for GB10 is (sm_121* would change the table)
    assert conf["gpu_code"]["wheel"]["sass"] in judged["archs"]
    assert not [a for a in judged["archs"] if a.startswith("sm_121")], judged["archs"]


def _decide(conf: dict) -> str:
    """source when the compile gives GB10 code the wheel lacks, or the wheel links a CUDA 12 runtime."""
    libs = WHEELS[conf["version"]]["libraries"].values()
    if any(lib["cuda_runtime"].startswith("libcudart.so.12") for lib in libs):
        return "source"
    wheel_sass = set().union(*(set(lib["sass"]) for lib in libs))
    table = _table(conf["version"], _patches(conf))
    compiled = set().union(*(_sass(v["gb10"]) for v in table.values()))
    return "source" if compiled - wheel_sass else "wheel"


@pytest.mark.parametrize("variant", IDS)
def test_install_decision_follows_from_the_data(variant):
    conf = VARIANTS[variant]
    assert _decide(conf) == conf.get("install", "source")


def test_blanket_sm121_fails_a_0260_listing_and_the_real_table_passes():
    listing = _listing(WHEELS["0.26.0"]["libraries"])
    old = spark_gpu_code_judge(listing, {"sass": "sm_121"})
    assert old["problems"] and "no sm_121 code in" in old["problems"][0]
    assert spark_gpu_code_judge(listing, VARIANTS["v0_26_dflash"]["gpu_code"]["source"])["problems"] == []


def test_marlin_ptx_only_without_acceptance_fails_naming_the_kernel():
    lib = dict(next(iter(WHEELS["0.26.0"]["libraries"].values())))
    lib.update(marlin_sm12x_sass=0, marlin_ptx_only_on_sm12x=731)
    judged = spark_gpu_code_judge(_listing({"vllm/_C.abi3.so": lib}), {"sass": "sm_120"})
    assert any("Marlin" in p and "_C.abi3.so" in p for p in judged["problems"]), judged


README = ROOT / "roles" / "vllm_build" / "README.md"
ARCH_TOKEN = re.compile(r"\b(?:sm|compute)_\d+[af]?\b")


def _readme_table() -> list[list[str]]:
    """The rows (cells) of the first table under "## GPU code per variant" in the role's README."""
    section = README.read_text().split("## GPU code per variant", 1)[1]
    rows, seen = [], False
    for line in section.splitlines():
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif seen:
            break
    return rows[1:]  # without the header


def _cell(text: str) -> tuple[str, set[str], str | None]:
    """(kind, architectures, CMakeLists.txt line) of a README cell or of a computed ``gb10`` value."""
    kind = "SASS" if text.startswith("SASS") else "PTX only" if text.startswith("PTX only") else text
    line = re.search(r"\(:(\d+)", text)
    return kind, set(ARCH_TOKEN.findall(text)), line.group(1) if line else None


def test_the_readme_table_is_what_the_release_cmake_makes():
    """Every CMake-derived row of roles/vllm_build/README.md "GPU code per variant" equals what vLLM's own
    CMake selection gives (0.19.1 as released, 0.19.1 with the Marlin build patch, 0.26.0), line numbers
    included; every kernel family we track has its row."""
    computed = [_table("0.19.1", ()), _table("0.19.1", _patches(VARIANTS["v0_19_1"])), _table("0.26.0", ())]
    by_var = {var: fam for fam, (var, _) in arch.FAMILIES.items()}
    rows = _readme_table()
    covered = set()
    for cells in rows:
        var = next((v for v in re.findall(r"`([A-Z0-9_]+)`", cells[0]) if v in by_var), None)
        if var is None:
            continue
        fam = by_var[var]
        covered.add(var)
        prev = None
        for col, table in zip(cells[1:4], computed, strict=True):
            want = table[fam]
            got = prev if col == "same" else _cell(col)
            kind, archs, line = _cell(want["gb10"])
            assert got[0] == kind and got[1] == archs, (cells[0], col, want)
            if col != "same" and got[2] is not None:
                assert got[2] == want["line"], (cells[0], col, want)
            prev = (got[0], got[1], None)
    assert covered == set(by_var), f"families without a README row: {set(by_var) - covered}"


def test_the_readme_fa2_row_is_the_wheel_listing_and_the_variants_accept_it():
    (fa2,) = [c for c in _readme_table() if "_vllm_fa2_C" in c[0]]
    lib = WHEELS["0.26.0"]["libraries"]["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"]
    assert not [a for a in lib["sass"] if a.startswith("sm_12")]  # no GB10 SASS in the wheel...
    kind, archs, _ = _cell(fa2[3])
    assert kind == "PTX only" and archs == set(lib["ptx"]) == {"compute_80"}  # ...only compute_80 PTX
    for variant, conf in VARIANTS.items():
        for mode in ("source", "wheel"):
            assert "_vllm_fa2_C" in conf["gpu_code"][mode].get("ptx_only_accepted", []), (variant, mode)
