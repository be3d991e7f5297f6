#!/usr/bin/env bash
# Everything outside Python that the whole suite needs, installed as root on a fresh machine:
# make, the docker engine (compose simulation), Go/protoc/Node (client examples), promtool,
# etcd (HA store), systemd-analyze (the systemd units' checks).
# Each step is idempotent and skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v make >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq make
fi
for step in scripts/ci-clients.sh scripts/docker-engine.sh scripts/prometheus-tools.sh scripts/etcd-server.sh \
    scripts/systemd-tools.sh; do
  if [ -f "$step" ]; then
    echo "ci-system-deps: $step"
    bash "$step"
  fi
done
