#!/usr/bin/env bash
# On the offline GPU host, from the project's root (what tests/gpu/gpu_bundle.sh staged here):
#   bash tests/gpu/gpu_host.sh stage         keep the carried bundle part(s) in /root/stage (idempotent)
#   bash tests/gpu/gpu_host.sh setup N       once all N parts are kept: unpack, install vLLM and its
#                                            missing packages into /root/site, fastsafetensors too,
#                                            and assemble a CUDA tree for FlashInfer's JIT (/root/cuda)
# After setup: export PYTHONPATH=/root/site; CUDA_HOME for FlashInfer is printed (cuda_home.sh).
# Exit 0 done, 1 a step failed, 2 usage.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=${GPU_BUNDLE_DIR:-.gpuwork/bundle}
mkdir -p /root/stage
case "${1:-}" in
  stage)
    for p in "$bundle"/part*; do [ -f "$p" ] || continue; cp "$p" /root/stage/; echo "kept $(basename "$p") $(stat -c %s "$p")"; done ;;
  setup)
    n=${2:?usage: gpu_host.sh setup N}
    have=$(ls /root/stage/part* 2>/dev/null | wc -l)
    [ "$have" -eq "$n" ] || { echo "gpu_host.sh: $have of $n parts in /root/stage; stage the rest first" >&2; exit 1; }
    rm -rf /root/stage/b && mkdir -p /root/stage/b
    cat /root/stage/part* | tar -x -C /root/stage/b
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site \
      /root/stage/b/v20carry/*.whl /root/stage/b/extra/*.whl /root/stage/b/fst/*.whl
    export PYTHONPATH=/root/site
    python3 -c "import vllm, torch, fastsafetensors; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    python3 -c "import vllm.entrypoints.openai.api_server" && echo api_server_import_ok
    bash "$here/cuda_home.sh" /root/stage/b/cuda /root/cuda ;;
  *) echo "usage: gpu_host.sh stage | setup N" >&2; exit 2 ;;
esac
