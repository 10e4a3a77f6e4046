"""Issue 33 item 3: the checked-in lock of each variant's whole Python set (roles/vllm_build/files/locks,
scripts/image_lock.py) covers every requirement of that variant (its toolchain pins, Ray, the release's own
runtime and build requirements, evaluated for Linux aarch64 / CPython 3.12), is current for its inputs, is
what the rendered Dockerfile installs (by hash, without the resolver), and the image's lock check
(roles/vllm_build/files/lock_check.py) fails an environment that differs from it.

The release's requirement files come from its sdist (scripts/sparkllm/lock/sources.py: cached per machine,
fetched from PyPI once)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

from tests.unit.test_dockerfile import LOCKS, VARIANTS, constraints, lock_files, rendered

ROOT = Path(__file__).resolve().parents[2]
import image_lock  # noqa: E402  (scripts/ and tests/contract are on pytest's pythonpath)
from sparkllm.lock import resolve as rr  # noqa: E402

LOCK_CHECK = ROOT / "roles" / "vllm_build" / "files" / "lock_check.py"
LINE = re.compile(r"^([a-z0-9][a-z0-9-]*)==(\S+)(?: \\\n    --hash=sha256:([0-9a-f]{64}))?$", re.M)


def parse(text: str) -> dict[str, tuple[str, str]]:
    """{name: (version, sha256 or "")} of a lock file; fails on a line that is neither a comment nor a pin."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    pins = {m.group(1): (m.group(2), m.group(3) or "") for m in LINE.finditer(body)}
    rest = LINE.sub("", body).strip()
    assert rest == "", f"lines that are not pins: {rest[:200]}"
    return pins


def lock(variant: str, stem: str) -> dict[str, tuple[str, str]]:
    return parse((LOCKS / variant / f"{stem}.txt").read_text())


def installed_set(variant: str, stage: str) -> dict[str, str]:
    """What the image has after ``stage`` (build, runtime-source, runtime-wheel): base, then the stage."""
    out = {n: v for stem in ("base", "base-index") for n, (v, _) in lock(variant, stem).items()}
    out.update({n: v for n, (v, _) in lock(variant, stage).items()})
    return out


def _unmet(reqs: list[str], have: dict[str, str]) -> list[str]:
    env = {**default_environment(), **rr.TARGET_ENV, "extra": ""}
    unmet = []
    for line in reqs:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate(env):
            continue
        name = image_lock.normalize(req.name)
        if name == "vllm":
            continue
        version = have.get(name)
        if version is None or not req.specifier.contains(Version(version), prereleases=True):
            unmet.append(f"{line} (lock: {version})")
    return unmet


def _stages(variant: str) -> list[str]:
    return ["runtime-source", *(["runtime-wheel"] if VARIANTS[variant].get("wheel") else [])]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_pin_has_its_wheel_s_sha256_but_the_unreachable_index_s(variant):
    files = {f.stem for f in (LOCKS / variant).glob("*.txt")}
    assert {"base", "base-index", "build", "runtime-source"} <= files
    index = {n for n, v in VARIANTS[variant]["toolchain"].items() if "+" in str(v)}
    for stem in files:
        for name, (_, sha) in lock(variant, stem).items():
            assert bool(sha) is (stem != "base-index"), (stem, name)
    assert set(lock(variant, "base-index")) <= index
    # an index package is either hashed in base or listed by version in base-index, never missing
    assert index <= set(lock(variant, "base")) | set(lock(variant, "base-index"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_lock_has_every_toolchain_pin_at_its_version(variant):
    pins = dict(line.split("==") for line in constraints(variant).splitlines()
                if line.strip() and not line.startswith("#"))
    for stage in _stages(variant):
        have = installed_set(variant, stage)
        assert {n: have.get(image_lock.normalize(n)) for n in pins} == pins, stage


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_lock_meets_every_runtime_requirement_of_the_release(variant, tmp_path):
    """The compiled wheel requires what setup.py reads after use_existing_torch.py (the build stage runs it:
    torchcodec and the torch lines go); the upstream wheel requires the file as released."""
    version = VARIANTS[variant]["version"]
    compiled = rr.setup_py_requirements(version, rr._release_tree(version, tmp_path / "src"))
    released = rr.setup_py_requirements(version)
    assert len(compiled) > 30  # the release's requirements/cuda.txt and common.txt, read for real
    for stage, reqs in (("runtime-source", compiled), ("runtime-wheel", released)):
        if stage in _stages(variant):
            have = installed_set(variant, stage)
            assert _unmet([*reqs, "ray[default]", "fastsafetensors"], have) == [], stage


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_lock_meets_every_build_requirement_of_the_release(variant, tmp_path):
    tree = rr._release_tree(VARIANTS[variant]["version"], tmp_path / "src")
    reqs = [line for r in VARIANTS[variant]["build_requirements"] for line in rr._flatten(tree / r)
            if line.strip() and not line.strip().startswith(("#", "-"))]
    assert reqs and not [r for r in reqs if r.startswith("torch")]  # use_existing_torch.py dropped them
    assert _unmet(reqs, installed_set(variant, "build")) == []


def test_a_requirement_the_lock_does_not_meet_is_found():
    have = installed_set("v0_19_1", "runtime-source")
    assert _unmet(["transformers>=99"], have) and _unmet(["no-such-package"], have)
    assert _unmet(["transformers>=99; platform_machine == 'x86_64'"], have) == []  # not for aarch64


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_lock_is_current_for_its_inputs(variant):
    """Changing a toolchain pin, the release or its requirement files without `make lock` fails here."""
    head = (LOCKS / variant / "base-index.txt").read_text()
    index_ok = "was reachable" in head
    digest = image_lock.inputs_digest(variant, VARIANTS[variant], index_ok)
    for f in (LOCKS / variant).glob("*.txt"):
        assert f.read_text().splitlines()[2] == f"# inputs sha256: {digest}", f"{f.name}: run `make lock`"
    bumped = {**VARIANTS[variant], "toolchain": {**VARIANTS[variant]["toolchain"], "transformers": "5.5.3"}}
    assert image_lock.inputs_digest(variant, bumped, index_ok) != digest


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("install", ["source", "wheel"])
def test_the_dockerfile_installs_each_stage_s_lock_by_hash_without_the_resolver(variant, install):
    source = install == "source"
    text = rendered(variant, install=install)
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    copied = {name for line in code.splitlines() if line.startswith("COPY lock/")
              for name in re.findall(r"lock/([\w-]+)\.txt", line)}
    assert copied == set(lock_files(variant, source, VARIANTS[variant]["flashinfer_aot"]))
    for key in copied - {"base-index"}:
        assert f"pip install --no-deps --require-hashes -r /opt/sparkllm/lock/{key}.txt" in code
    installs = re.findall(r"pip install ([^\\\n&]*)", code)
    allowed = re.compile(r"--no-deps --require-hashes -r /opt/sparkllm/lock/[\w-]+\.txt|"
                         r"--no-index --dry-run .*|-r /opt/sparkllm/lock/base-index\.txt|"
                         r"--no-deps /opt/sparkllm/(wheels/vllm|flashinfer-jit-cache/)\S*\.whl.*")
    assert [i for i in installs if not allowed.fullmatch(i.strip())] == []
    # the index packages go through the resolver only when the lock could not hash them
    assert ("pip install -r /opt/sparkllm/lock/base-index.txt" in code) is bool(lock(variant, "base-index"))
    assert code.count("pip check") == 2 and code.count("/opt/sparkllm/lock_check.py") >= 2
    assert "pip install --upgrade pip" not in code  # pip itself comes from the lock


def _site(tmp_path: Path, dists: dict[str, tuple[str, list[str]]]) -> Path:
    site = tmp_path / "site"
    for name, (version, requires) in dists.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}",
                *(f"Requires-Dist: {r}" for r in requires)]
        (info / "METADATA").write_text("\n".join(meta) + "\n")
    return site


def _check(tmp_path: Path, site: Path, lock_text: str, *extra: str) -> subprocess.CompletedProcess:
    f = tmp_path / "lock.txt"
    f.write_text(lock_text)
    return subprocess.run([sys.executable, "-S", str(LOCK_CHECK), *extra, str(f)], capture_output=True,
                          text=True, check=False, env={"PYTHONPATH": str(site)})


LOCKED = "# header\nalpha==1.0 \\\n    --hash=sha256:" + "a" * 64 + "\nbeta-pkg==2.0\n"


@pytest.mark.parametrize(("dists", "extra", "rc", "said"), [
    ({"alpha": ("1.0", []), "beta_pkg": ("2.0", [])}, [], 0,
     "2 locked, 0 pinned by dependents, 0 differences"),
    ({"alpha": ("1.1", []), "beta_pkg": ("2.0", [])}, [], 1, "alpha is installed at 1.1, the lock has 1.0"),
    ({"alpha": ("1.0", [])}, [], 1, "beta-pkg==2.0 is locked but not installed"),
    ({"alpha": ("1.0", []), "beta_pkg": ("2.0", []), "gamma": ("3.0", [])}, [], 1,
     "gamma==3.0 is installed but not in the lock"),
    ({"alpha": ("1.0", ["gamma (==3.0)", "delta>=1"]), "beta_pkg": ("2.0", []), "gamma": ("3.0", [])}, [], 0,
     "gamma==3.0 (pinned by alpha)"),
    ({"alpha": ("1.0", ["gamma>=3.0"]), "beta_pkg": ("2.0", []), "gamma": ("3.0", [])}, [], 1,
     "gamma==3.0 is installed but not in the lock"),
    ({"alpha": ("1.0", []), "beta_pkg": ("2.0", []), "vllm": ("0.19.1", [])}, ["--also", "vllm"], 0,
     "0 differences"),
])
def test_the_lock_check_accepts_only_the_lock(tmp_path, dists, extra, rc, said):
    res = _check(tmp_path, _site(tmp_path, dists), LOCKED, *extra)
    assert res.returncode == rc, res.stdout + res.stderr
    assert said in res.stdout + res.stderr


def test_the_lock_check_refuses_a_missing_lock_file(tmp_path):
    res = subprocess.run([sys.executable, "-S", str(LOCK_CHECK), str(tmp_path / "none.txt")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 2 and "lock files missing" in res.stderr


PYPI_TORCH = sorted(v for v in VARIANTS if not image_lock.index_packages(VARIANTS[v]))


def test_only_a_cu130_pin_is_an_index_package():
    assert image_lock.index_packages(VARIANTS["v0_19_1"]) == {"torch", "torchvision", "torchaudio"}
    assert PYPI_TORCH == ["v0_26_dflash"]  # its torch 2.11.0: PyPI's aarch64 wheel is the cu130 build


@pytest.mark.parametrize("variant", PYPI_TORCH)
def test_a_variant_whose_torch_is_on_pypi_locks_it_by_hash_without_the_index(variant):
    """torch, torchvision and torchaudio pinned by their public version come from PyPI like everything else:
    hashed in base.txt with torch's CUDA 13 libraries, base-index.txt lists nothing, and the image never
    names the PyTorch index (tests/unit/test_vllm_toolchains.py holds PyPI's wheels to the cu130 build)."""
    assert lock(variant, "base-index") == {}
    assert "PyTorch index is not used" in (LOCKS / variant / "base-index.txt").read_text()
    base = lock(variant, "base")
    toolchain = VARIANTS[variant]["toolchain"]
    for name in ("torch", "torchvision", "torchaudio"):
        version, sha = base[name]
        assert version == str(toolchain[name]) and re.fullmatch(r"[0-9a-f]{64}", sha), name
    # torch's own ==-pins on Linux (cuda-toolkit 13.0.2, the -cu13 libraries) are locked, not left to pip
    assert base["cuda-toolkit"][0] == "13.0.2"
    cu13 = {n for n in base if n.startswith("nvidia-") and n.endswith("-cu13")}
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cusparselt-cu13", "nvidia-nvshmem-cu13"} <= cu13
    assert not [n for n in base if n.endswith("-cu12")]
    for install in ("source", "wheel"):
        text = rendered(variant, install=install)
        assert "PIP_EXTRA_INDEX_URL" not in text and "download.pytorch.org" not in text, install
        assert "pip install -r /opt/sparkllm/lock/base-index.txt" not in text


def test_a_cu130_variant_keeps_the_pytorch_index():
    text = rendered("v0_19_1")
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu130" in text
