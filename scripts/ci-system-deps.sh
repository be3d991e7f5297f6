#!/usr/bin/env bash
# System packages the test suite needs (installed as root; each step is skipped when present).
set -euo pipefail
need=()
command -v make >/dev/null || need+=(make)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq "${need[@]}"
fi
