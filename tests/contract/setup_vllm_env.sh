#!/usr/bin/env bash
# Create the contract-test environment: the real vLLM 0.19.1 from PyPI in .venv-vllm.
#
# Idempotent: when .venv-vllm already imports vllm 0.19.1 this exits in about a second.
# A fresh install downloads about 11 GB (vllm pins torch 2.10.0) and takes a few minutes.
# The machine-wide pip constraint (/etc/xdg/pip/constraints.txt, torch<=2.14.1) is compatible.
#
# Usage: tests/contract/setup_vllm_env.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
# Env:   PYTHON (default python3.11), VLLM_VERSION (default 0.19.1)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-${repo_root}/.venv-vllm}"
python="${PYTHON:-python3.11}"
vllm_version="${VLLM_VERSION:-0.19.1}"

probe() {
  "${venv}/bin/python" - "${vllm_version}" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("vllm") == sys.argv[1]
import pytest, safetensors, numpy, yaml  # noqa: F401,E401
PY
}

if [ -x "${venv}/bin/python" ] && probe; then
  echo "setup_vllm_env: ${venv} already has vllm ${vllm_version}; nothing to do"
  exit 0
fi

start=$(date +%s)
if [ ! -x "${venv}/bin/python" ]; then
  echo "setup_vllm_env: creating ${venv} with ${python}"
  "${python}" -m venv "${venv}"
fi
"${venv}/bin/python" -m pip install --quiet --upgrade pip
echo "setup_vllm_env: installing vllm==${vllm_version} (about 11 GB, several minutes)"
"${venv}/bin/python" -m pip install --progress-bar off \
  "vllm==${vllm_version}" pytest==8.4.2 safetensors==0.7.0 numpy pyyaml==6.0.3
if ! probe; then
  echo "setup_vllm_env: ${venv} still does not import vllm ${vllm_version}; see the pip output above" >&2
  exit 1
fi
echo "setup_vllm_env: done in $(( $(date +%s) - start )) s; size $(du -sh "${venv}" | cut -f1)"
