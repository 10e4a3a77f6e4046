#!/usr/bin/env bash
# On the offline GPU host, from the project's root (what tests/gpu/gpu_bundle.sh staged here):
#   bash tests/gpu/gpu_host.sh stage         keep the carried bundle part(s) in $GPU_STAGE (default
#                                            /root/stage; idempotent)
#   bash tests/gpu/gpu_host.sh setup N       once all N parts are kept: unpack, install vLLM and its
#                                            missing packages into $GPU_SITE (default /root/site),
#                                            fastsafetensors too, and, where the bundle has the
#                                            compiler wheels, a CUDA tree for FlashInfer's JIT (/root/cuda)
# After setup: export PYTHONPATH=/root/site; CUDA_HOME for FlashInfer is printed (cuda_home.sh).
# Exit 0 done, 1 a step failed, 2 usage.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=${GPU_BUNDLE_DIR:-.gpuwork/bundle}
stage=${GPU_STAGE:-/root/stage}   # one per vLLM version (tests/gpu/prepare_v026.sh uses /root/stage026)
site=${GPU_SITE:-/root/site}
mkdir -p "$stage"
case "${1:-}" in
  stage)
    for p in "$bundle"/part*; do [ -f "$p" ] || continue; cp "$p" "$stage/"; echo "kept $(basename "$p") $(stat -c %s "$p")"; done ;;
  setup)
    n=${2:?usage: gpu_host.sh setup N}
    have=$(ls "$stage"/part* 2>/dev/null | wc -l)
    [ "$have" -eq "$n" ] || { echo "gpu_host.sh: $have of $n parts in $stage; stage the rest first" >&2; exit 1; }
    b=$stage/b; rm -rf "$b" && mkdir -p "$b"
    cat "$stage"/part* | tar -x -C "$b"
    # gpu_bundle.sh's layout (vLLM 0.20.0: v20carry/ extra/ fst/ cuda/) or prepare_v026.sh's (wheels/)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      $(ls "$b"/v20carry/*.whl "$b"/extra/*.whl "$b"/fst/*.whl "$b"/wheels/*.whl 2>/dev/null)
    export PYTHONPATH=$site
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    python3 -c "import fastsafetensors" 2>/dev/null && echo fastsafetensors_ok
    python3 -c "import vllm.entrypoints.openai.api_server" && echo api_server_import_ok
    if [ -d "$b/cuda" ]; then bash "$here/cuda_home.sh" "$b/cuda" /root/cuda; fi ;;
  *) echo "usage: gpu_host.sh stage | setup N" >&2; exit 2 ;;
esac
