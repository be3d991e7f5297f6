#!/usr/bin/env bash
# Installs promtool (Debian's `prometheus` package) for the observability tests: `promtool test
# rules` on deploy/prometheus/, `promtool check metrics` on every service's /metrics.
# Idempotent; root only. ci-system-deps.sh calls it. The package's own prometheus service is not
# started (no init system in CI containers; the tests run their own servers when they need one).
set -euo pipefail

log() { echo "prometheus-tools: $*" >&2; }

if command -v promtool >/dev/null; then
  log "promtool already installed ($(promtool --version 2>&1 | head -n 1))"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  log "promtool is missing; run this script as root (it installs Debian's prometheus package)"
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt_opts=(-o DPkg::Lock::Timeout=600)
log "installing Debian's prometheus package (promtool) with apt-get"
apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends prometheus >/dev/null \
  || { apt-get "${apt_opts[@]}" update -qq &&
       apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends prometheus >/dev/null; }
log "$(promtool --version 2>&1 | head -n 1)"
