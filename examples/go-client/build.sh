#!/usr/bin/env bash
# Builds bin/motor-go-client offline: generates the Go stubs from proto/ with protoc,
# protoc-gen-go and protoc-gen-go-grpc into bin/gopath (ignored by git, so they can never go
# stale), then compiles against Debian's grpc-go and google.golang.org/protobuf in GOPATH mode.
# Needs: golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev
# golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev (scripts/ci-clients.sh installs them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$here/bin"
gopath="$out/gopath"

rm -rf "$gopath/src/github.com/motor-llm"
mkdir -p "$gopath/src"
# go_package in the protos is github.com/motor-llm/motor/gen/go/motor/v1: with the default
# paths=import the files land at that import path under $gopath/src.
protoc -I"$repo/proto" --go_out="$gopath/src" --go-grpc_out="$gopath/src" "$repo"/proto/motor/v1/*.proto

export GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOFLAGS=
export GOCACHE="${GOCACHE:-$out/gocache}"
cd "$here"
go vet .
go build -o "$out/motor-go-client" .
echo "built $out/motor-go-client"
