#!/usr/bin/env bash
# Builds bench/fleet/bin/motor-fleet (the simulated fleet of bench/controller_scale.py) offline,
# the way examples/go-client/build.sh builds the Go client: stubs generated from proto/ into
# bin/gopath (ignored by git), then Go in GOPATH mode against Debian's grpc-go and protobuf
# (scripts/ci-clients.sh installs them).
set -euo pipefail
fleet="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$fleet/../.." && pwd)"
mkdir -p "$fleet/bin/gopath/src"
protoc -I"$root/proto" --go_out="$fleet/bin/gopath/src" --go-grpc_out="$fleet/bin/gopath/src" "$root"/proto/motor/v1/*.proto
cd "$fleet"
GO111MODULE=off GOPATH="$fleet/bin/gopath:/usr/share/gocode" GOFLAGS= GOCACHE="${GOCACHE:-$fleet/bin/gocache}" \
  go build -o "$fleet/bin/motor-fleet" .
echo "built $fleet/bin/motor-fleet"
