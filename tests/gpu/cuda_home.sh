#!/usr/bin/env bash
# Assemble a CUDA 13 tree for FlashInfer's JIT (nvcc at first use) on a host that has the CUDA 13
# runtime as Python wheels (torch's nvidia/cu13) but no nvcc, from the compiler's PyPI wheels:
#   nvidia-cuda-nvcc 13.0.88, nvidia-nvvm 13.0.88 (cicc, libdevice), nvidia-cuda-crt 13.0.88,
#   nvidia-cuda-cccl 13.0.85 (pip download --no-deps --platform manylinux2014_x86_64 ... on a machine
#   with network; see docs/gpu-e2e/README.md).
#     bash tests/gpu/cuda_home.sh WHEEL_DIR DEST      -> prints the CUDA_HOME (DEST/site/nvidia/cu13)
# The host's own cu13 headers and libraries (cuda_runtime.h, libcudart) are linked in, lib64 and
# lib64/stubs/libcuda.so are made as FlashInfer's link line expects; a one-kernel sm_90a compile
# checks the result. Exit 0 ready, 1 a step failed, 2 usage.
set -euo pipefail
[ $# -eq 2 ] && [ -d "$1" ] || { echo "usage: cuda_home.sh WHEEL_DIR DEST" >&2; exit 2; }
whl=$1; dest=$2
ls "$whl"/nvidia_cuda_nvcc-*.whl "$whl"/nvidia_nvvm-*.whl "$whl"/nvidia_cuda_crt-*.whl \
   "$whl"/nvidia_cuda_cccl-*.whl >/dev/null || { echo "cuda_home.sh: a compiler wheel is missing in $whl" >&2; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$dest/site" \
  "$whl"/nvidia_cuda_nvcc-*.whl "$whl"/nvidia_nvvm-*.whl "$whl"/nvidia_cuda_crt-*.whl "$whl"/nvidia_cuda_cccl-*.whl >&2
home=$dest/site/nvidia/cu13
hostcu=$(python3 - <<'PY'
import os, nvidia
for p in nvidia.__path__:
    if os.path.isfile(os.path.join(p, "cu13", "include", "cuda_runtime.h")):
        print(os.path.join(p, "cu13")); break
PY
)
[ -n "$hostcu" ] || { echo "cuda_home.sh: no nvidia/cu13/include/cuda_runtime.h in this python's packages" >&2; exit 1; }
cp -rsn "$hostcu"/include/. "$home"/include/
mkdir -p "$home/lib"; cp -rsn "$hostcu"/lib/. "$home"/lib/
[ -e "$home/lib64" ] || ln -s lib "$home/lib64"
[ -e "$home/lib/libcudart.so" ] || ln -s "$(ls "$home"/lib/libcudart.so.* | head -1)" "$home/lib/libcudart.so"
mkdir -p "$home/lib/stubs"
libcuda=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
[ -n "$libcuda" ] && ln -sf "$libcuda" "$home/lib/stubs/libcuda.so"
t=$(mktemp -d)
printf '__global__ void k(float* x){ x[threadIdx.x] += 1.f; }\nint main(){ return 0; }\n' > "$t/k.cu"
"$home/bin/nvcc" -arch=sm_90a -o "$t/k" "$t/k.cu" >&2 || { echo "cuda_home.sh: nvcc could not build a test kernel" >&2; exit 1; }
rm -rf "$t"
echo "$home"
