#!/usr/bin/env bash
# Build the Java client library and its example into OUT/qosgate-example.jar (run by
# `make clients-java`), offline: javac on Debian's jars in /usr/share/java, stubs generated
# at build time from protos/ and from DESCRIPTORS (scripts/protocol_descriptors.py: KServe v2)
# by protoc and grpc-java's plugin.
#
# Usage: clients/java/build.sh DESCRIPTORS OUT
set -euo pipefail

descriptors=$(realpath "$1")
out=$(realpath -m "$2")
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

# What the jar runs on: grpc-java, protobuf-java (google.rpc's classes included), netty,
# and what they load at run time; geronimo-annotation only compiles (@Generated).
runtime=(grpc-api grpc-core grpc-context grpc-netty grpc-protobuf grpc-protobuf-lite grpc-stub
  protobuf proto-google-common-protos guava gson perfmark-api
  netty-buffer netty-codec netty-codec-http netty-codec-http2 netty-codec-socks netty-common
  netty-handler netty-handler-proxy netty-resolver netty-transport netty-tcnative)
jars=()
for name in "${runtime[@]}"; do
  jars+=("/usr/share/java/$name.jar")
done
compile_path=$(IFS=:; echo "${jars[*]}:/usr/share/java/geronimo-annotation-1.3-spec.jar")

rm -rf "$out/gen" "$out/classes" && mkdir -p "$out/gen" "$out/classes"
java_plugin=(--plugin=protoc-gen-grpc-java=/usr/bin/grpc_java_plugin --java_out="$out/gen" --grpc-java_out="$out/gen")
protoc -I protos "${java_plugin[@]}" protos/qosgate/v1/*.proto
protoc --descriptor_set_in="$descriptors" "${java_plugin[@]}" model_config.proto grpc_service.proto
find "$out/gen" clients/java/src/main/java -name '*.java' > "$out/sources.txt"
javac -nowarn -d "$out/classes" -cp "$compile_path" @"$out/sources.txt"

# TLS: Debian's netty has no ALPN over the JDK's TLS (its patches drop the negotiators
# that need a newer Java at build time), and gRPC needs ALPN, so TLS runs on OpenSSL through
# netty-tcnative. Debian installs that native library under a name netty's loader never
# tries; the loader also looks in the jar, under META-INF/native/, so it goes there.
tcnative=$(dpkg -L libnetty-tcnative-jni | grep '/libnetty-tcnative\.so$')
mkdir -p "$out/classes/META-INF/native"
cp "$tcnative" "$out/classes/META-INF/native/libnetty_tcnative.so"

# The manifest names the jars by absolute path, so `java -jar` needs no class path; its
# lines are at most 72 bytes, continued on lines that start with a space.
printf 'Class-Path: %s\n' "${jars[*]}" | fold -w 70 | sed '2,$s/^/ /' > "$out/manifest.txt"
jar --create --file "$out/qosgate-example.jar" --main-class io.qosgate.example.Example \
  --manifest "$out/manifest.txt" -C "$out/classes" .
echo "built $out/qosgate-example.jar"
