#!/usr/bin/env bash
# Makes a docker engine and docker-compose available for the compose simulation (root only).
# Idempotent: installs Debian's docker.io / docker-compose when missing, starts dockerd in the
# background when it is not answering, and waits for its socket. CI calls it before the tests.
#
# dockerd runs with --iptables=false (machines without netfilter rights) and the vfs storage
# driver (works on any filesystem, including overlay-in-overlay). Override with DOCKERD_ARGS.
set -euo pipefail

DOCKERD_ARGS=${DOCKERD_ARGS:---iptables=false --storage-driver=vfs}
DOCKER_SOCK=${DOCKER_SOCK:-/var/run/docker.sock}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/motor-dockerd.log}
WAIT_S=${DOCKER_WAIT_S:-60}

log() { echo "docker-engine: $*" >&2; }

need=()
command -v dockerd >/dev/null || need+=(docker.io)
# Either compose flavour will do: v2 as a docker CLI plugin, or the v1.29 Python tool.
if ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then
  need+=(docker-compose)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing ${need[*]}; run this script as root (it installs them with apt-get)"
    exit 1
  fi
  log "installing ${need[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  # Lock timeout: other setup steps may be running apt-get at the same time.
  apt_opts=(-o DPkg::Lock::Timeout=600)
  apt-get "${apt_opts[@]}" update -qq
  apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if docker info >/dev/null 2>&1; then
  log "dockerd already running"
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  log "dockerd is not answering on $DOCKER_SOCK; start it as root (this script does that)"
  exit 1
fi

if ! pgrep -x dockerd >/dev/null; then
  # A socket left behind by a dead dockerd would make the wait below succeed too early.
  rm -f "$DOCKER_SOCK"
  log "starting dockerd $DOCKERD_ARGS (log: $DOCKERD_LOG)"
  # setsid: dockerd outlives this script and the shell that called it. The other descriptors are
  # closed first: a lock the caller holds (flock around a test run) must not live on in dockerd.
  # shellcheck disable=SC2086
  (
    for fd in /proc/self/fd/*; do
      n=${fd##*/}
      if [ "$n" -gt 2 ]; then eval "exec $n>&-" 2>/dev/null || true; fi
    done
    exec setsid dockerd $DOCKERD_ARGS >>"$DOCKERD_LOG" 2>&1 < /dev/null
  ) &
fi

for _ in $(seq "$WAIT_S"); do
  if [ -S "$DOCKER_SOCK" ] && docker info >/dev/null 2>&1; then
    log "dockerd ready"
    exit 0
  fi
  sleep 1
done
log "dockerd did not answer within ${WAIT_S}s; last lines of $DOCKERD_LOG:"
tail -n 20 "$DOCKERD_LOG" >&2 || true
exit 1
