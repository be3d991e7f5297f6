#!/usr/bin/env bash
# Builds a small local Debian base image with python3 + venv for the compose simulation, for
# machines that cannot pull from a container registry (root; needs debootstrap and dockerd).
#   scripts/build-base-image.sh [IMAGE]      (default motor-base:bookworm; FORCE=1 rebuilds)
# DEBIAN_PACKAGES (comma-separated) replaces the packages installed; the compose simulation's
# Prometheus image is built the same way:
#   DEBIAN_PACKAGES=prometheus scripts/build-base-image.sh motor-prometheus:bookworm
# The Debian mirror is read from this machine's apt sources (DEBIAN_MIRROR overrides it), so it
# works wherever apt-get works.
set -euo pipefail

IMAGE=${1:-${MOTOR_BASE_IMAGE:-motor-base:bookworm}}
SUITE=${DEBIAN_SUITE:-bookworm}
PACKAGES=${DEBIAN_PACKAGES:-python3,python3-venv,ca-certificates}

log() { echo "build-base-image: $*" >&2; }

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "$IMAGE already exists (FORCE=1 rebuilds it)"
  exit 0
fi

# The first Debian archive URI in the apt sources (deb822 .sources files, then one-line lists).
apt_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }' "$f"
  done | head -n 1
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { if ($i !~ /security/) print $i; break } }' "$f"
  done | head -n 1
}
MIRROR=${DEBIAN_MIRROR:-$(apt_mirror | head -n 1)}
if [ -z "$MIRROR" ]; then
  log "no Debian mirror found in /etc/apt/sources.list{,.d}; set DEBIAN_MIRROR=http://.../debian"
  exit 1
fi

if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap with apt-get"
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends debootstrap >/dev/null \
    || { apt-get -o DPkg::Lock::Timeout=600 update -qq &&
         apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends debootstrap >/dev/null; }
fi

ROOTFS=$(mktemp -d /tmp/motor-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
log "debootstrap $SUITE from $MIRROR (about a minute)"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
  || { tail -n 20 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"
# Not needed in a container, and with the vfs storage driver every byte is copied per layer.
rm -rf "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* \
  "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/locale/* \
  "$ROOTFS"/var/log/* "$ROOTFS"/tmp/*
log "docker import -> $IMAGE ($(du -sh "$ROOTFS" | cut -f1))"
tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change "CMD [\"${PACKAGES%%,*}\"]" \
  --message "debootstrap $SUITE minbase + $PACKAGES (scripts/build-base-image.sh)" - "$IMAGE" >/dev/null
if [[ ",$PACKAGES," == *,python3,* ]]; then
  docker run --rm "$IMAGE" python3 -c 'import sys, venv; print("build-base-image: python", sys.version.split()[0])' >&2
fi
log "done: $IMAGE"
