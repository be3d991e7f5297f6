#!/usr/bin/env bash
# Builds the wheelhouse the compose image installs from (pip --no-index): the motor wheel and its
# runtime dependencies only (not vLLM), at the versions installed in .venv, so the image runs what
# the test suite tested and builds without network access.
#   scripts/build-wheelhouse.sh [DIR]        (default docker/wheelhouse)
# The wheels must suit the image's Python: 3.11 on x86_64/aarch64 glibc (Debian bookworm,
# python:3.11-slim).
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${1:-docker/wheelhouse}
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
log() { echo "build-wheelhouse: $*" >&2; }

[ -x "$PY" ] || { log "$PY is missing: run 'make setup' (scripts/setup-venv.sh) first"; exit 1; }
mkdir -p "$DIR"
# The tested versions: every name==version pin of the venv (editable/URL installs left out).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" -m pip --disable-pip-version-check freeze --exclude-editable | grep -E '^[A-Za-z0-9_.-]+==' > "$constraints"
rm -f "$DIR"/motor-*.whl
# --no-build-isolation: build the motor wheel with the venv's pinned setuptools.
"$PY" -m pip --disable-pip-version-check wheel -q --no-build-isolation \
  --wheel-dir "$DIR" --find-links "$DIR" -c "$constraints" ".[router]" 2>&1 \
  | { grep -v "is ignored: it is neither" || true; }
ls "$DIR"/motor-*.whl >/dev/null
log "$(ls "$DIR" | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
