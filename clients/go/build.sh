#!/usr/bin/env bash
# Build the Go client library and its example into OUT (run by `make clients-go`), offline:
# Go in GOPATH mode on Debian's golang-* packages (/usr/share/gocode), stubs generated at
# build time from protos/ and from DESCRIPTORS (scripts/protocol_descriptors.py: KServe v2).
#
# Usage: clients/go/build.sh DESCRIPTORS OUT
set -euo pipefail

descriptors=$(realpath "$1")
out=$(realpath -m "$2")
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

# The generated packages sit where their go_package says, under a GOPATH of our own; the
# library joins them there as a link to clients/go, so its import path is stable.
module=$out/gopath/src/github.com/qosgate/qosgate
rm -rf "$module" && mkdir -p "$module/clients" "$out/bin"
ln -s "$root/clients/go" "$module/clients/go"
protoc -I protos --go_out="$out/gopath/src" --go-grpc_out="$out/gopath/src" protos/qosgate/v1/*.proto
# Triton's files name no go_package: give them one.
kserve=github.com/qosgate/qosgate/gen/go/inference
maps=()
for file in model_config.proto grpc_service.proto; do
  maps+=("--go_opt=M$file=$kserve;inference" "--go-grpc_opt=M$file=$kserve;inference")
done
protoc --descriptor_set_in="$descriptors" --go_out="$out/gopath/src" --go-grpc_out="$out/gopath/src" \
  "${maps[@]}" model_config.proto grpc_service.proto

# Go's own build cache (GOCACHE, default ~/.cache/go-build) is content-addressed: every
# checkout shares what it compiled of gRPC.
export GO111MODULE=off GOPATH="$out/gopath:/usr/share/gocode"
go vet github.com/qosgate/qosgate/clients/go/qosgate github.com/qosgate/qosgate/clients/go/cmd/qosgate-example
go build -o "$out/bin/qosgate-example" github.com/qosgate/qosgate/clients/go/cmd/qosgate-example
echo "built $out/bin/qosgate-example"
