#!/usr/bin/env bash
# Toolchains for the Go and JavaScript example clients (examples/go-client, examples/js-client)
# and their tests: Debian's Go 1.19, protoc, protoc-gen-go, protoc-gen-go-grpc, grpc-go and
# google.golang.org/protobuf (the Go client builds offline from them), Node.js and npm. Idempotent and quiet: each step is skipped when what it installs is there.
# Needs root for apt-get (CI runs as root); the npm packages come from the committed lockfile.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

need=()
command -v go >/dev/null || need+=(golang-go)
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v protoc-gen-go >/dev/null || need+=(protoc-gen-go)
command -v protoc-gen-go-grpc >/dev/null || need+=(protoc-gen-go-grpc)
[ -d /usr/share/gocode/src/google.golang.org/grpc ] || need+=(golang-google-grpc-dev)
[ -d /usr/share/gocode/src/google.golang.org/protobuf ] || need+=(golang-google-protobuf-dev)
# grpc-go takes github.com/golang/protobuf 1.3 or 1.5; stubs from protoc-gen-go 1.28 need 1.5.
dpkg -s golang-github-golang-protobuf-1-5-dev >/dev/null 2>&1 || need+=(golang-github-golang-protobuf-1-5-dev)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  echo "ci-clients: installing ${need[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The JS client's pinned packages, exactly as locked (npm ci), only when the lockfile changed.
js=examples/js-client
stamp="$js/node_modules/.motor-lock-sha"
want=$(sha256sum "$js/package-lock.json" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "ci-clients: npm ci in $js"
  (cd "$js" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  echo "$want" > "$stamp"
fi
