#!/usr/bin/env bash
# Installs systemd-analyze (Debian's `systemd` package) for tests/deploy/test_systemd.py, which runs
# `systemd-analyze verify` and `systemd-analyze security --offline` on deploy/systemd's units in a
# scratch root; nothing is started (CI containers run no init system). Idempotent; root only.
# ci-system-deps.sh calls it.
set -euo pipefail

log() { echo "systemd-tools: $*" >&2; }

if command -v systemd-analyze >/dev/null && [ -d /usr/lib/systemd/system ]; then
  log "systemd-analyze already installed ($(systemd-analyze --version | head -n 1))"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  log "systemd-analyze is missing; run this script as root (it installs Debian's systemd package)"
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt_opts=(-o DPkg::Lock::Timeout=600)
log "installing Debian's systemd package (systemd-analyze) with apt-get"
apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends systemd >/dev/null \
  || { apt-get "${apt_opts[@]}" update -qq &&
       apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends systemd >/dev/null; }
log "$(systemd-analyze --version | head -n 1)"
