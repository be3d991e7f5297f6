#!/usr/bin/env bash
# etcd for the high-availability store and its tests (docs/ha.md): Debian's etcd-server 3.4,
# which brings `etcd` and `etcdctl`. Idempotent: nothing happens when `etcd` is on PATH.
# Needs root for apt-get (CI runs as root).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
  echo "etcd-server: installing Debian's etcd-server"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends etcd-server etcd-client >/dev/null
fi
# The package enables a system etcd on 2379 where systemd runs; Motor's tests and
# `motorctl up --ha` start their own members, so keep that one from holding the port.
if command -v systemctl >/dev/null && systemctl is-active --quiet etcd 2>/dev/null; then
  systemctl disable --now etcd >/dev/null 2>&1 || true
fi
echo "etcd-server: $(etcd --version | sed -n 1p)"
