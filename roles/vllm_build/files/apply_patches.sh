#!/bin/sh
# Applies a patch series inside an image build (used by every vllm_build Dockerfile).
#   usage: apply_patches.sh PATCH_DIR SOURCE_DIR
# PATCH_DIR/series lists patch files in order (blank lines and '#' comments ignored). Each patch
# is probed with `git apply --check` against the tree as the previous patches left it; the first
# one that does not apply stops the build with a line the vllm_build role looks for:
#   SPARKLLM-PATCH-FAILED: <patch name>
set -eu
patch_dir=$1
cd "$2"
series="$patch_dir/series"
if [ ! -s "$series" ]; then
  echo "sparkllm: no patches to apply"
  exit 0
fi
count=0
while IFS= read -r line || [ -n "$line" ]; do
  name=$(printf '%s' "$line" | sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]].*$//')
  [ -n "$name" ] || continue
  if [ ! -f "$patch_dir/$name" ]; then
    echo "SPARKLLM-PATCH-FAILED: $name (listed in series, file missing)"
    exit 1
  fi
  if ! git apply --check --verbose "$patch_dir/$name"; then
    echo "SPARKLLM-PATCH-FAILED: $name (git apply --check: it no longer applies to this source tree)"
    exit 1
  fi
  git apply "$patch_dir/$name"
  count=$((count + 1))
  echo "sparkllm: applied $name"
done <"$series"
echo "sparkllm: applied $count patch(es)"
