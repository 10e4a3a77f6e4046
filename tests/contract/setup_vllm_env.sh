#!/usr/bin/env bash
# Create the contract-test environment.
#
# 1. .venv-vllm: the real vLLM 0.19.1 from PyPI (+ pytest, safetensors, numpy, pyyaml); by default a link to
#    a venv kept per machine (see machine_cache below).
#    A fresh install downloads about 11 GB (vllm pins torch 2.10.0) and takes about 5 minutes.
#    The machine-wide pip constraint (/etc/xdg/pip/constraints.txt, torch<=2.14.1) is compatible.
# 2. .cache/vllm-<V>-py for V in 0.20.0 and 0.26.0: the pure-Python part of each wheel, downloaded
#    without dependencies (~245 MB wheel, ~40 MB extracted, compiled extensions left out). Both
#    carry our patches' contracts (patches/vllm-<V>, INC hybrid and INT8 LM head); 0.26.0 is also the
#    dflash variant (v0_26_dflash): the contract tests put it first on PYTHONPATH in a subprocess of
#    .venv-vllm to ask its own `vllm serve` parser and SpeculativeConfig about the dflash arguments. A second full environment (torch 2.11, another ~11 GB and ~5 min)
#    would buy nothing more: without a GPU only the parser and config classes can be exercised.
#
# 3-6. CMake, the pinned vLLM sdists and FlashInfer wheels, pip's dry-run resolution of every variant's
#    installs, and the diffs of the upstream PRs the builds carry (below).
#
# Idempotent: when everything exists it exits in a few seconds.
#
# Usage: tests/contract/setup_vllm_env.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
# Env:   PYTHON (default python3.11), VLLM_VERSION (0.19.1), VLLM_OVERLAY_VERSIONS ("0.20.0 0.26.0";
#        empty to skip step 2)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
default_venv="${repo_root}/.venv-vllm"
venv="${1:-${default_venv}}"
python="${PYTHON:-python3.11}"
vllm_version="${VLLM_VERSION:-0.19.1}"
contract_pins="pytest==8.4.2 safetensors==0.7.0 numpy pyyaml==6.0.3"
# Per-machine cache (scripts/sparkllm/lock/sources.py MACHINE_CACHE): pinned downloads, pip's resolutions, and
# the contract venv itself (~11 GB, minutes to install): the default .venv-vllm is a link to a venv there,
# named by the sha256 of what it is made of, so a fresh clone (CI) links the one already installed.
machine_cache="${SPARKLLM_MACHINE_CACHE:-${XDG_CACHE_HOME:-${HOME}/.cache}/sparkllm}"
if [ "${venv}" = "${default_venv}" ] && [ ! -e "${venv}" ] && [ ! -L "${venv}" ]; then
  key=$(printf '%s\n' "vllm==${vllm_version}" "${contract_pins}" "$("${python}" -c 'import sys; print(sys.version)')" \
        | sha256sum | cut -c1-16)
  shared="${machine_cache}/venv-vllm-${vllm_version}-${key}"
  mkdir -p "${machine_cache}"
  ln -s "${shared}" "${venv}"
  echo "setup_vllm_env: ${venv} -> ${shared} (per-machine venv)"
fi
# the directory the venv really is (the link's target, created below when it does not exist yet). Everything
# runs through its own path, never through the link: pip writes the interpreter path it ran under into the
# console scripts it installs, and a clone's .venv-vllm link dies with the clone.
venv_dir="$(readlink -f "${venv}" 2>/dev/null || echo "${venv}")"
py="${venv_dir}/bin/python"
# 0.20.0: the hybrid patch of patches/vllm-0.20.0; 0.26.0: the dflash variant's serve arguments
overlay_versions="${VLLM_OVERLAY_VERSIONS-0.20.0 0.26.0}"
cache="${repo_root}/.cache"
mkdir -p "${cache}"  # a fresh clone has none until molecule runs; every step below writes into it

probe() {
  "${py}" - "${vllm_version}" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("vllm") == sys.argv[1]
import pytest, safetensors, numpy, yaml  # noqa: F401,E401
PY
}

start=$(date +%s)
if [ -x "${py}" ] && probe; then
  echo "setup_vllm_env: ${venv} already has vllm ${vllm_version}"
else
  if [ ! -x "${py}" ]; then
    echo "setup_vllm_env: creating ${venv_dir} with ${python}"
    "${python}" -m venv "${venv_dir}"
  fi
  "${py}" -m pip install --quiet --upgrade pip
  echo "setup_vllm_env: installing vllm==${vllm_version} (about 11 GB, several minutes)"
  # shellcheck disable=SC2086  # contract_pins: one requirement per word
  "${py}" -m pip install --progress-bar off "vllm==${vllm_version}" ${contract_pins}
  if ! probe; then
    echo "setup_vllm_env: ${venv} still does not import vllm ${vllm_version}; see the pip output above" >&2
    exit 1
  fi
fi

for dflash_version in ${overlay_versions}; do
  overlay="${cache}/vllm-${dflash_version}-py"
  if [ -f "${overlay}/.complete" ]; then
    echo "setup_vllm_env: ${overlay} already present"
  else
    echo "setup_vllm_env: fetching the vllm ${dflash_version} wheel (no dependencies) for the dflash contract"
    wheels="${machine_cache}/vllm-wheels"  # kept: a fresh clone extracts again without downloading
    mkdir -p "${wheels}"
    "${py}" -m pip download --quiet --no-deps --only-binary=:all: \
      -d "${wheels}" "vllm==${dflash_version}"
    tmp="$(mktemp -d "${cache}/vllm-overlay.XXXXXX")"
    "${py}" - "${wheels}" "${dflash_version}" "${tmp}" <<'PY'
import glob, sys, zipfile
wheels, version, dest = sys.argv[1:]
(wheel,) = glob.glob(f"{wheels}/vllm-{version}-*.whl")
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.startswith("vllm/") and not m.endswith(".so")]
    z.extractall(dest, members)
PY
    touch "${tmp}/.complete"
    rm -rf "${overlay}"
    mv "${tmp}" "${overlay}"
  fi
done
# 3. CMake from PyPI (tests/contract/test_build_arch_contract.py runs vLLM's own arch selection in `cmake -P`)
#    and the pinned sdist of every variant (data/vllm_sdists.json, sha256-checked; ~/.cache/sparkllm/vllm-sdist, extracted
#    to .cache/vllm-src/<V>): downloaded once, a rerun only checks the stamps.
cmake_version="4.4.5"
# the binary inside the cmake wheel (what tests/contract/vllm_cmake_archs.py find_cmake runs), not bin/cmake
cmake_bin() { "${py}" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))' 2>/dev/null; }
if "$(cmake_bin || echo false)" --version 2>/dev/null | grep -qx "cmake version ${cmake_version}"; then
  echo "setup_vllm_env: cmake ${cmake_version} already in ${venv}"
else
  echo "setup_vllm_env: installing cmake==${cmake_version} into ${venv}"
  "${py}" -m pip install --quiet --progress-bar off "cmake==${cmake_version}"
fi
PYTHONPATH="${repo_root}/scripts" "${py}" -m sparkllm.lock.sources
# 4. The flashinfer-python wheel of every variant (data/flashinfer_packages.json, sha256-checked; the AOT step's
#    contract reads its aot.py, jit/ and file list from .cache/flashinfer-src/<V>): 8 + 15 MB, once.
"${py}" "${repo_root}/tests/contract/flashinfer_sources.py"
# 5. pip's dry-run resolution of what each variant's image installs, for Linux aarch64 / CPython 3.12
#    (scripts/sparkllm/lock/resolve.py): about a minute per install set the first time (HTTP range
#    reads of each wheel's METADATA), then cached per machine (~/.cache/sparkllm/pip-resolve/) by the sha256
#    of every input.
PYTHONPATH="${repo_root}/scripts" "${py}" -m sparkllm.lock.resolve
# 6. The diff of every upstream commit a build carries (extra_prs entries with diff_sha256; tests/contract/vllm_prs.py):
#    made as the image build makes it (a two-commit fetch from github.com, the role's git diff options), checked
#    against the pinned sha256, kept in ~/.cache/sparkllm/vllm-prs/; a rerun only checks the hash.
"${py}" "${repo_root}/tests/contract/vllm_prs.py"

echo "setup_vllm_env: done in $(( $(date +%s) - start )) s; ${venv}: $(du -sh "${venv}/" | cut -f1)"
