#!/usr/bin/env bash
# Here (a machine with network), from the project's root: vLLM 0.26.0 (the DFlash variant) for the
# offline x86_64 GPU host, whose Python has torch 2.11.0+cu130 (0.26.0's pin) and the packages of
# ../shared/gpu/device-freeze.txt. pip's resolver runs for Linux x86_64 / CPython 3.12 with stand-in
# torch wheels (a local version tag, which pip prefers; so the host's CUDA torch stack is kept), and only what the host lacks is carried,
# minus heavy optional kernel packages (as for 0.20.0). Output: .gpuwork/bundle026/partNN (sized so
# that one part plus the working tree fits a 64 MiB call, one per upload; .gpuwork/ is ignored through .git/info/exclude) holding wheels/*.whl.
# On the host: each call carries one part and runs
#   GPU_BUNDLE_DIR=.gpuwork/bundle026 GPU_STAGE=/root/stage026 bash tests/gpu/gpu_host.sh stage
# and the last adds `GPU_STAGE=/root/stage026 GPU_SITE=/root/site026 bash tests/gpu/gpu_host.sh setup N`
# (then PYTHONPATH=/root/site026). Exit 0 done, 1 a step failed.
set -euo pipefail
freeze=${DEVICE_FREEZE:-../shared/gpu/device-freeze.txt}
[ -f "$freeze" ] || { echo "prepare_v026.sh: no $freeze (the GPU host's package list); set DEVICE_FREEZE" >&2; exit 1; }
grep -qxF /.gpuwork/ .git/info/exclude 2>/dev/null || echo /.gpuwork/ >> .git/info/exclude
W=${TMPDIR:-/tmp}/vllm026-prep; rm -rf "$W"; mkdir -p "$W/fake" "$W/b/wheels"
PLAT="--python-version 3.12 --implementation cp --only-binary=:all:"
for t in 35 34 31 28 27 24 17; do PLAT="$PLAT --platform manylinux_2_${t}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
python3 - "$W/fake" <<'PY'
import sys, zipfile
for name, ver in [("torch", "2.11.0+standin"), ("torchaudio", "2.11.0+standin"), ("torchvision", "0.26.0+standin")]:
    di = f"{name}-{ver}.dist-info"
    with zipfile.ZipFile(f"{sys.argv[1]}/{name}-{ver}-py3-none-any.whl", "w") as z:
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: sparkllm-standin\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
PY
# the host's own versions as constraints: what it has is kept, not replaced (torch's family excepted:
# the stand-ins stand for it)
grep -E '^[A-Za-z0-9_.-]+==' "$freeze" | grep -viE '^(torch|torchaudio|torchvision)==' > "$W/constraints.txt"
# where vLLM pins another version than the host's (pip names one conflict at a time), that
# constraint is dropped and the pinned version carried (it shadows the host's through PYTHONPATH)
: > "$W/dropped.txt"
for try in $(seq 1 15); do
  if python3 -m pip install --dry-run --ignore-installed --report "$W/report.json" $PLAT \
       --find-links "$W/fake" --target "$W/target" -c "$W/constraints.txt" vllm==0.26.0 > "$W/resolve.log" 2>&1; then
    break
  fi
  pkg=$(sed -n 's/^ *The user requested (constraint) \([A-Za-z0-9_.-]*\)==.*/\1/p' "$W/resolve.log" | head -1)
  [ -n "$pkg" ] || { grep -v '^WARNING' "$W/resolve.log" >&2; echo "prepare_v026.sh: pip cannot resolve vllm==0.26.0 (above)" >&2; exit 1; }
  grep -vi "^${pkg}==" "$W/constraints.txt" > "$W/c2" && mv "$W/c2" "$W/constraints.txt"
  grep -E 'depends on|constraint' "$W/resolve.log" | sed 's/^ *//' >> "$W/dropped.txt"
done
[ -s "$W/report.json" ] || { echo "prepare_v026.sh: no resolution after 15 tries" >&2; exit 1; }
echo "host versions replaced by vLLM 0.26.0's pins:"; cat "$W/dropped.txt"
python3 - "$W/report.json" "$freeze" "$W/need.txt" <<'PY'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n.lower())
have = {norm(m.group(1)): m.group(2) for m in (re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", l) for l in open(sys.argv[2])) if m}
skip = {"flashinfer-cubin", "flashinfer-jit-cache", "tilelang", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
        "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-core", "quack-kernels", "cuda-tile", "z3-solver",
        "nvidia-cudnn-frontend", "sentry-sdk", "fastapi-cloud-cli", "rich-toolkit", "torch", "torchaudio", "torchvision",
        # not needed by tests/gpu/dflash_bench.py (FLASH_ATTN, no FlashInfer JIT, no MLA, no video; the host's
        # numba 0.68.0 / numpy 2.5.2 serve vLLM's n-gram code): 788 MB in 13 uploads -> 363 MB in 6 (2026-12-02)
        "tokenspeed-triton", "tokenspeed-mla", "nvidia-cutlass-dsl-libs-cu13", "nvidia-nvvm", "nvidia-cuda-nvcc",
        "nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-cuda-nvdisasm", "llvmlite", "numba", "numpy",
        "pynvvideocodec", "torchcodec"}
need = []
for i in json.load(open(sys.argv[1]))["install"]:
    n, v = i["metadata"]["name"], i["metadata"]["version"]
    if norm(n) in skip or have.get(norm(n)) == v:
        continue
    need.append(f"{n}=={v}")
open(sys.argv[3], "w").write("\n".join(need) + "\n")
print(len(need), "packages to carry (host lacks them or has another version)")
PY
python3 -m pip download -q --no-deps $PLAT -d "$W/b/wheels" -r "$W/need.txt"
du -sh "$W/b/wheels"
mkdir -p .gpuwork/bundle026 && rm -f .gpuwork/bundle026/part*
part_mib=$(bash "$(dirname "$0")/part_mib.sh")   # one part + the working tree fit a 64 MiB call
tar -cf - -C "$W/b" . | split -b "${part_mib}M" -d - .gpuwork/bundle026/part
cp "$W/need.txt" .gpuwork/bundle026/need.txt; cp "$W/dropped.txt" .gpuwork/bundle026/replaced.txt
rm -rf "$W"
ls -la .gpuwork/bundle026
