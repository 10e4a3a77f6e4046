#!/usr/bin/env bash
# Build the systemd test-host image used by every molecule scenario, without any registry:
# debootstrap a minimal Debian bookworm with systemd, then `docker import` it.
# Reused when the tag already exists (pass --force to rebuild).
set -euo pipefail

TAG="${SPARK_TESTHOST_IMAGE:-spark-testhost:bookworm}"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

if [ "$FORCE" = 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "test-host image $TAG exists; reusing it"
  exit 0
fi

# The Debian mirror comes from this machine's apt configuration (deb822 or one-line format).
mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
  # first deb822 stanza or one-line entry whose suite is bookworm and whose component is main
  mirror=$(python3 - <<'PY'
import glob, re
stanzas = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for block in open(path, encoding="utf-8").read().split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+):[ \t]*(.*)$", block, re.M))
        stanzas.append((fields.get("URIs", ""), fields.get("Suites", ""), fields.get("Components", "")))
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line.strip())
        if m:
            stanzas.append(m.groups())
for uris, suites, comps in stanzas:
    if "bookworm" in suites.split() and "main" in comps.split():
        print(uris.split()[0])
        break
PY
)
fi
if [ -z "$mirror" ]; then
  echo "cannot find a Debian bookworm mirror in /etc/apt; set DEBIAN_MIRROR=http://..." >&2
  exit 1
fi

command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }

work=$(mktemp -d /var/tmp/spark-testhost.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
echo "debootstrap bookworm from $mirror into $rootfs"
# docker.io gives the test host a docker CLI; its own daemon is masked below because
# the scenarios mount the machine's /var/run/docker.sock instead.
debootstrap --variant=minbase \
  --include=systemd,systemd-sysv,dbus,python3,python3-requests,python3-venv,python3-pip,sudo,iproute2,procps,curl,ca-certificates,docker.io,iputils-ping \
  bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

for unit in docker.service docker.socket containerd.service; do
  ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"
done
# units that make no sense in a container
for unit in systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket \
            getty.target console-getty.service systemd-networkd-wait-online.service; do
  ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"
done
echo "deb $mirror bookworm main" > "$rootfs/etc/apt/sources.list"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*

tar -C "$rootfs" -c . | docker import -c 'CMD ["/lib/systemd/systemd"]' -c 'ENV container=docker' - "$TAG" >/dev/null
echo "built $TAG"
