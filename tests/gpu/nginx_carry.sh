#!/usr/bin/env bash
# Here, on a Debian or Ubuntu machine with network and the GPU host's architecture: put the distribution's
# nginx binary in DIR (default .gpuwork/nginx/nginx) for `make gpu-proxy` on the offline GPU host:
#   bash tests/gpu/nginx_carry.sh            then carry .gpuwork/nginx and run there
#   make gpu-proxy PYTHON=python3 ARGS="--nginx $PWD/.gpuwork/nginx/nginx"
# The binary links only libc, libcrypt, libpcre2-8, libssl3 and zlib, which Ubuntu 24.04 has.
# Exit 0 done, 1 a step failed, 2 usage.
set -euo pipefail
[ $# -le 1 ] || { echo "usage: nginx_carry.sh [DIR]" >&2; exit 2; }
dest=${1:-.gpuwork/nginx}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download nginx >/dev/null 2>&1); then
  echo "nginx_carry.sh: apt-get download nginx failed (no network, or run apt-get update first)" >&2
  exit 1
fi
dpkg -x "$tmp"/nginx_*.deb "$tmp/root"
mkdir -p "$dest"
install -m 0755 "$tmp/root/usr/sbin/nginx" "$dest/nginx"
"$dest/nginx" -v
