"""pip's own resolver, dry-run, over what each variant's image installs, for Linux aarch64 / CPython 3.12.

What templates/Dockerfile.j2 installs, per variant, under the variant's constraints file (the same lines
roles/vllm_build/templates/constraints.txt.j2 writes; tests/unit/test_resolve_inputs.py checks both agree):

- ``build``: the base stage's torch/triton names plus the release's build-requirements files
  (``spark_vllm_variants.<v>.build_requirements``) as the build stage has them, i.e. after the release's own
  ``use_existing_torch.py`` ran on a copy of the sdist's requirements (it drops the torch lines);
- ``runtime-source``: the base names, the wheel the compile makes (its Requires-Dist are what the release's
  ``setup.py`` ``get_requirements()`` reads from ``requirements/cuda.txt`` for a CUDA 13 build, after
  ``use_existing_torch.py``), ``ray[default]`` and ``fastsafetensors``;
- ``runtime-wheel`` (variants with ``install: wheel``): the same with the pinned upstream wheel by its URL.

Each set is resolved by ``pip install --dry-run --report --ignore-installed --only-binary=:all:`` with the
target's platform tags, ``--python-version 3.12 --implementation cp --target``. Two things pip does not do by
itself for a foreign target, done here:

- ``--platform manylinux_2_39_aarch64`` alone would accept only that exact tag (pip expands manylinux2014 and
  manylinux2010 to older tags, not ``manylinux_2_x``): every tag glibc 2.39 accepts is passed;
- environment markers are evaluated against the interpreter running pip (x86_64, 3.11 here: vLLM's
  ``setuptools<81; python_version > "3.11"`` was dropped and setuptools 81 picked), so pip runs with
  ``packaging.markers.default_environment`` answering for the target (TARGET_ENV).

PyPI serves no PEP 658 metadata for these wheels, so pip's lazy wheels (``--use-feature=fast-deps``: HTTP
range requests of each wheel's METADATA) keep a resolution at a few MB instead of GBs. The result (resolved
or not, with pip's error; a run that could not reach an index is reported and not cached) is cached per
machine (vllm_sources.MACHINE_CACHE: ~/.cache/sparkllm/pip-resolve, so a fresh clone reuses it) under the
sha256 of every input: the requirement lines, the constraints, pip's version, the target, the index mode,
this file. A second run costs nothing; ``--refresh`` asks PyPI again.

torch, torchvision and torchaudio pinned ``+cu130`` come from the PyTorch index
(``vllm_build_torch_index_url``, the Dockerfile's PIP_EXTRA_INDEX_URL; those builds are only there); a
variant that pins them by their public version (PyPI's aarch64 wheels are the CUDA 13 build) never asks
that index. When it is reachable it is used exactly so. When it is not (this machine, its CI), the three
are resolved from PyPI at their public versions (``torch==2.10.0`` for ``2.10.0+cu130``) and the result
says so: the pins and everything around them resolve, the cu130 wheels' own dependency lists are not read
(PyPI's aarch64 torch 2.10.0 is a CPU build; its 2.11.0 is the CUDA 13 build, requiring cuda-toolkit 13.0.2,
which is why the 0.26 variant pins it by its public version).

    PYTHONPATH=scripts python -m sparkllm.lock.resolve [--refresh] [VARIANT ...]

Exit status: 0 every set has a result (resolved or not: printed), 1 pip could not be run or PyPI not
reached, 2 usage. Run by tests/contract/setup_vllm_env.sh; tests/contract/test_requirements_resolve.py
asserts the results.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from functools import cache
from pathlib import Path

import yaml

from ..cli import UsageError, WorkFailed, doc_parser, run_main
from ..fileio import write_json_atomic
from . import sources as vllm_sources

ROOT = Path(__file__).resolve().parents[3]  # the checkout (scripts/sparkllm/lock/resolve.py)

CACHE = vllm_sources.MACHINE_CACHE / "pip-resolve"  # per machine: keyed by the sha256 of every input
METHODS = ROOT / "group_vars" / "all" / "methods.yml"
DEFAULTS = ROOT / "roles" / "vllm_build" / "defaults" / "main.yml"
PYPI = "https://pypi.org/simple"
# the base image (Ubuntu 24.04, glibc 2.39, its python3 3.12) on the Spark (aarch64)
GLIBC_MINOR = 39
PLATFORMS = [*(f"manylinux_2_{m}_aarch64" for m in range(GLIBC_MINOR, 16, -1)),
             "manylinux2014_aarch64", "linux_aarch64"]
TARGET_ENV = {
    "implementation_name": "cpython", "implementation_version": "3.12.3", "os_name": "posix",
    "platform_machine": "aarch64", "platform_release": "", "platform_system": "Linux",
    "platform_version": "", "python_full_version": "3.12.3", "platform_python_implementation": "CPython",
    "python_version": "3.12", "sys_platform": "linux",
}
# what the Dockerfile's runtime stage adds to the vLLM wheel (templates/Dockerfile.j2, block runtime)
RUNTIME_EXTRAS = ['"ray[default]"', "fastsafetensors"]
# pip's own lines when an index could not be reached (such a run is reported, never cached)
NETWORK = re.compile(r"Retrying \(Retry\(|NewConnectionError|Failed to establish a new connection|"
                     r"Name or service not known|Temporary failure in name resolution|Network is unreachable|"
                     r"HTTP error 5\d\d|Read timed out|ProxyError|Max retries exceeded")
# pip's progress lines (left out of a failure's text)
PROGRESS = re.compile(r"\s*(Collecting|Obtaining dependency information|Using cached|Downloading|"
                      r"Would install) ")
# runs pip with the target's marker environment (argv[1] is TARGET_ENV as JSON)
BOOT = """\
import json, sys
import pip._vendor.packaging.markers as markers
import pip._internal.models.installation_report as report
env = json.loads(sys.argv.pop(1))
markers.default_environment = lambda: dict(env)
report.default_environment = markers.default_environment
from pip._internal.cli.main import main
sys.exit(main())
"""


def variants() -> dict:
    return yaml.safe_load(METHODS.read_text())["spark_vllm_variants"]


def ray_version() -> str:
    return str(yaml.safe_load(METHODS.read_text())["spark_ray_version"])


def constraints_lines(conf: dict) -> list[str]:
    """The variant's constraints file, line by line, as constraints.txt.j2 renders it (without comments)."""
    pins = {**conf["toolchain"], "ray": ray_version()}
    return [f"{name}=={pins[name]}" for name in sorted(pins, key=str.lower)]


def base_names(conf: dict) -> list[str]:
    """The base stage's `pip install` names (the Dockerfile: toolchain names matching ^(torch|triton))."""
    return [n for n in sorted(conf["toolchain"]) if re.match(r"^(torch|triton)", n)]


def torch_index() -> str:
    return yaml.safe_load(DEFAULTS.read_text())["vllm_build_torch_index_url"]


@cache
def index_reachable(url: str, timeout: float = 10) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


def uses_torch_index(lines: list[str]) -> bool:
    """Whether constraint lines pin a PyTorch-index build (a local version label such as +cu130)."""
    return any(re.search(r"\+[A-Za-z0-9.]+$", line) for line in lines)


def public_pins(lines: list[str]) -> list[str]:
    """Pins with the local version label dropped (2.10.0+cu130 -> 2.10.0): PyPI stands in for the index."""
    return [re.sub(r"\+[A-Za-z0-9.]+$", "", line) for line in lines]


def _release_tree(version: str, dest: Path) -> Path:
    """A copy of the release's requirements/, pyproject.toml and use_existing_torch.py, after that ran."""
    src = vllm_sources.source_tree(version)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src / "requirements", dest / "requirements")
    for name in ("pyproject.toml", "use_existing_torch.py"):
        shutil.copy2(src / name, dest / name)
    subprocess.run([sys.executable, "use_existing_torch.py"], cwd=dest, check=True, capture_output=True)
    return dest


def setup_py_requirements(version: str, tree: Path | None = None) -> list[str]:
    """The install_requires of a CUDA 13 build: the release's setup.py get_requirements() on cuda.txt.

    Its rules, read from that release's setup.py: `-r` includes followed, lines starting with `--` or `#`
    and blank ones dropped; vllm-flash-attn dropped when CUDA is not 12.x; flashinfer-cubin dropped where
    setup.py says so (0.26.0: "Not on PyPI since 0.6.14"); the [cu13] extras kept (CUDA 13). Inline
    comments are dropped as setuptools does. ``tree`` defaults to the sdist as released.
    """
    tree = tree or vllm_sources.source_tree(version)
    setup = (vllm_sources.source_tree(version) / "setup.py").read_text()
    req_dir = tree / "requirements"

    def read(name: str) -> list[str]:
        out = []
        for line in (req_dir / name).read_text().strip().split("\n"):
            if line.startswith("-r "):
                out += read(line.split()[1])
            elif not line.startswith(("--", "#")) and line.strip():
                out.append(line)
        return out

    reqs = []
    for req in read("cuda.txt"):
        if "vllm-flash-attn" in req and '"vllm-flash-attn" in req and cuda_major != "12"' in setup:
            continue
        if "flashinfer-cubin" in req and 'if "flashinfer-cubin" in req:' in setup:
            continue
        reqs.append(re.sub(r"\s+#.*$", "", req).strip())
    return reqs


def install_sets(name: str, conf: dict, work: Path) -> dict[str, list[str]]:
    """{set name: pip arguments (requirements)} of one variant; files are written under ``work``."""
    tree = _release_tree(conf["version"], work / "src")
    base = base_names(conf)
    sets = {"build": [*base, *(a for r in conf["build_requirements"] for a in ("-r", str(tree / r)))]}
    reqs = work / "vllm-install-requires.txt"
    reqs.write_text("\n".join(setup_py_requirements(conf["version"], tree)) + "\n")
    extras = [e.strip('"') for e in RUNTIME_EXTRAS]
    sets["runtime-source"] = [*base, "-r", str(reqs), *extras]
    if conf.get("install") == "wheel":
        sets["runtime-wheel"] = [*base, f"vllm @ {conf['wheel']['url']}", *extras]
    return sets


@cache
def pip_version() -> str:
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True,
                         check=True)
    return out.stdout.split()[1]


def _key_material(args: list[str], constraints: list[str], mode: dict) -> dict:
    files = {}
    for i, a in enumerate(args):
        if a == "-r":
            path = Path(args[i + 1])
            files[path.name + ":" + str(i)] = _flatten(path)
    return {"args": [Path(a).name if Path(a).is_absolute() else a for a in args], "files": files,
            "constraints": constraints, "pip": pip_version(), "platforms": PLATFORMS, "env": TARGET_ENV,
            "mode": mode, "resolver": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}


def _flatten(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip().startswith("-r"):
            out += _flatten(path.parent / line.strip()[2:].strip())
        else:
            out.append(line)
    return out


def _pip_env() -> dict[str, str]:
    """The caller's environment without pip settings (a host's constraints or find-links must not leak in)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def resolve(variant: str, set_name: str, *, pins: dict[str, str] | None = None, refresh: bool = False,
            index_ok: bool | None = None) -> dict:
    """The dry-run result of one install set: {"ok", "install": {name: version}, "error", "mode", ...}.

    ``pins`` replaces or adds toolchain pins (the tests inject a bad one to show the check fails)."""
    conf = variants()[variant]
    if pins:
        conf = {**conf, "toolchain": {**conf["toolchain"], **pins}}
    if index_ok is None:
        index_ok = index_reachable(torch_index())
    lines = constraints_lines(conf)
    mode = {"torch_index": torch_index(), "torch_index_reachable": index_ok,
            "torch_index_used": index_ok and uses_torch_index(lines)}
    if not index_ok:
        lines = public_pins(lines)
    with tempfile.TemporaryDirectory(prefix="pip-resolve-") as tmp:
        work = Path(tmp)
        args = install_sets(variant, conf, work)[set_name]
        material = _key_material(args, lines, mode)
        key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
        cached = CACHE / f"{variant}-{set_name}-{key[:20]}.json"
        if cached.is_file() and not refresh:
            return json.loads(cached.read_text())
        (work / "constraints.txt").write_text("\n".join(lines) + "\n")
        cmd = [sys.executable, "-c", BOOT, json.dumps(TARGET_ENV), "install", "--dry-run",
               "--report", str(work / "report.json"), "--ignore-installed", "--only-binary=:all:",
               *(a for p in PLATFORMS for a in ("--platform", p)), "--python-version", "3.12",
               "--implementation", "cp", "--target", str(work / "target"), "--use-feature=fast-deps",
               "--no-cache-dir", "--index-url", PYPI,
               *(["--extra-index-url", torch_index()] if mode["torch_index_used"] else []),
               "-c", str(work / "constraints.txt"), *args]
        res = subprocess.run(cmd, capture_output=True, text=True, env=_pip_env(), check=False)
        # pip's explanation of a failure ("The conflict is caused by: ...") is on stdout among its progress
        # lines, the ERROR lines on stderr: keep both, without the progress
        said = [line for line in (res.stdout + "\n" + res.stderr).splitlines()
                if line.strip() and "fast-deps" not in line and not PROGRESS.match(line)]
        err = "\n".join(said).strip()
        if res.returncode != 0 and NETWORK.search(err):  # not cached: offline is no answer about the pins
            raise RuntimeError(f"pip could not reach an index for {variant}/{set_name}: {err[-600:]}")
        result = {"variant": variant, "set": set_name, "ok": res.returncode == 0, "key": key, "mode": mode,
                  "pip": pip_version(), "constraints": lines, "requirements": material["args"],
                  "error": err[-4000:] if res.returncode else "", "install": {}}
        if res.returncode == 0:
            report = json.loads((work / "report.json").read_text())
            result["install"] = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                                 for i in report["install"]}
            result["environment"] = report["environment"]
        CACHE.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cached, result)
        return result


def resolve_all(variants_asked: list[str], refresh: bool) -> int:
    """Resolve every set of each variant asked (all when none), printing one line per set."""
    known = variants()
    unknown = [v for v in variants_asked if v not in known]
    if unknown:
        raise UsageError(f"no variant {', '.join(unknown)} in {METHODS}")
    index_ok = index_reachable(torch_index())
    if not index_ok:
        print(f"resolve_requirements: {torch_index()} is unreachable from here: torch, torchvision and "
              "torchaudio resolve from PyPI at their public versions (their cu130 wheels' own dependencies "
              "are not read)")
    for v in variants_asked or sorted(known):
        with tempfile.TemporaryDirectory() as tmp:
            names = list(install_sets(v, known[v], Path(tmp)))
        for s in names:
            try:
                r = resolve(v, s, refresh=refresh, index_ok=index_ok)
            except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                raise WorkFailed(f"{v}/{s}: {exc}") from None
            state = f"resolves ({len(r['install'])} packages)" if r["ok"] else "DOES NOT RESOLVE"
            print(f"resolve_requirements: {v}/{s}: {state}")
            if not r["ok"]:
                print(r["error"][-1500:])
    return 0


def main(argv: list[str] | None = None) -> int:
    p = doc_parser("resolve_requirements", __doc__)
    p.add_argument("variants", nargs="*", help="variants of spark_vllm_variants (default: all)")
    p.add_argument("--refresh", action="store_true",
                   help="ask PyPI again instead of using the cached resolution")
    args = p.parse_args(argv)
    return run_main("resolve_requirements", lambda: resolve_all(args.variants, args.refresh))


if __name__ == "__main__":
    sys.exit(main())
