#!/bin/sh
# Applies a patch series inside an image build (used by every vllm_build Dockerfile).
#   usage: apply_patches.sh PATCH_DIR SOURCE_DIR [MODULE_DIR]
# MODULE_DIR (default PATCH_DIR/src) holds the modules our patches call, carried once for every
# version: MODULE_DIR/modules lists "<file> <destination relative to SOURCE_DIR>" per line, and each
# file is installed there first (a destination that exists with other content is not replaced: the
# build stops, naming it). Then PATCH_DIR/series lists patch files in order (blank lines and '#'
# comments ignored). Each patch
# is probed with `git apply --check` against the tree as the previous patches left it; the first
# one that does not apply stops the build with a line the vllm_build role looks for:
#   SPARKLLM-PATCH-FAILED: <patch name>
set -eu
if [ "$#" -lt 2 ] || [ "$#" -gt 3 ]; then
  echo "usage: $0 PATCH_DIR SOURCE_DIR [MODULE_DIR]" >&2
  exit 2
fi
patch_dir=$(cd "$1" && pwd)
module_dir=${3:-$patch_dir/src}
[ -d "$module_dir" ] && module_dir=$(cd "$module_dir" && pwd)
cd "$2"
if [ -f "$module_dir/modules" ]; then
  installed=0
  while IFS= read -r line || [ -n "$line" ]; do
    line=$(printf '%s' "$line" | sed -e 's/#.*//')
    set -f
    # shellcheck disable=SC2086
    set -- $line
    set +f
    [ "$#" -gt 0 ] || continue
    if [ "$#" -ne 2 ]; then
      echo "SPARKLLM-PATCH-FAILED: src/modules (line '$line': want '<file> <destination>')"
      exit 1
    fi
    case "$1/$2" in
      /* | */../* | ../* | */.. | */ | *//*)
        echo "SPARKLLM-PATCH-FAILED: src/modules (line '$line': file and destination must be relative, without ..)"
        exit 1 ;;
    esac
    if [ ! -f "$module_dir/$1" ]; then
      echo "SPARKLLM-PATCH-FAILED: src/$1 (listed in src/modules, file missing)"
      exit 1
    fi
    if [ -e "$2" ] && ! cmp -s "$module_dir/$1" "$2"; then
      echo "SPARKLLM-PATCH-FAILED: src/$1 ($2 already exists with other content; not ours to replace)"
      exit 1
    fi
    mkdir -p "$(dirname "$2")"
    cp "$module_dir/$1" "$2.sparkllm-tmp" && mv -f "$2.sparkllm-tmp" "$2"
    installed=$((installed + 1))
    echo "sparkllm: installed src/$1 as $2"
  done <"$module_dir/modules"
  echo "sparkllm: installed $installed module(s)"
fi
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
