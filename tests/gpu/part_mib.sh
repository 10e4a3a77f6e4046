#!/usr/bin/env bash
# Prints the size, in MiB, of a bundle part that fits one device call beside this working tree.
# A call carries the tree (tracked + untracked, not ignored) AND one part, 64 MiB in all; a part is
# what is left after the tree and a 2 MiB margin (a 61 MiB part was ~9 KB over with a 3 MiB tree).
# Used by gpu_bundle.sh (vLLM 0.20.0) and prepare_v026.sh (0.26.0). Exit 0 printed, 1 no room.
set -euo pipefail
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null \
  | awk '{ s += $1 } END { print s + 0 }')
part_mib=$(( (64 * 1048576 - tree_bytes - 2 * 1048576) / 1048576 ))
[ "$part_mib" -ge 8 ] || { echo "part_mib.sh: the working tree ($tree_bytes bytes) leaves no room for a part" >&2; exit 1; }
echo "working tree $tree_bytes bytes: parts of $part_mib MiB" >&2
echo "$part_mib"
