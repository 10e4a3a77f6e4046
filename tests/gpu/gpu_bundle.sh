#!/usr/bin/env bash
# Here (a machine with network), from the project's root, after `bash ../shared/gpu/prepare.sh` (vLLM
# 0.20.0's .stage/): one bundle of everything the GPU host lacks for tests/gpu/first_start.py, in
# parts that each fit one 64 MiB upload beside the working tree:
#   .stage/part* (vLLM 0.20.0 + its missing packages), .stage/*.whl (xgrammar, apache_tvm_ffi),
#   the CUDA 13.0 compiler wheels for FlashInfer's JIT (nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt
#   13.0.88, nvidia-cuda-cccl 13.0.85: the host's runtime is 13.0) and fastsafetensors 0.5.0 (our pin).
# Output: .gpuwork/bundle/partNN (sized by part_mib.sh so one part and the tree fit a call; .gpuwork/ ignored through .git/info/exclude).
# On the host: each call carries one part and runs `bash tests/gpu/gpu_host.sh stage`; the last adds
# `&& bash tests/gpu/gpu_host.sh setup N`. Exit 0 done, 1 a step failed.
set -euo pipefail
ls .stage/part00 >/dev/null 2>&1 || { echo "gpu_bundle.sh: no .stage/part00; run bash ../shared/gpu/prepare.sh first" >&2; exit 1; }
grep -qxF /.gpuwork/ .git/info/exclude 2>/dev/null || echo /.gpuwork/ >> .git/info/exclude
W=${TMPDIR:-/tmp}/gpu-bundle; rm -rf "$W"; mkdir -p "$W/b/extra" "$W/b/cuda" "$W/b/fst"
PLAT="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for t in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64; do PLAT="$PLAT --platform $t"; done
python3 -m pip download -q $PLAT -d "$W/b/cuda" nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
python3 -m pip download -q $PLAT -d "$W/b/fst" fastsafetensors==0.5.0
cat .stage/part* | tar -x -C "$W/b"
cp .stage/*.whl "$W/b/extra/"
mkdir -p .gpuwork/bundle && rm -f .gpuwork/bundle/part*
part_mib=$(bash "$(dirname "$0")/part_mib.sh")   # one part + the working tree fit a 64 MiB call
tar -cf - -C "$W/b" . | split -b "${part_mib}M" -d - .gpuwork/bundle/part
rm -rf "$W"
ls -la .gpuwork/bundle
