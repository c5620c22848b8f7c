# infernode's build. Every target installs what it needs on a fresh Debian machine (as root),
# so `make test` and `make run` work from a clean clone with nothing installed by hand.

GO      ?= go
MODEL   ?= models/infernode-tiny.gguf
BENCH_MODEL ?= models/smollm2-135m-shape.gguf
NODES   ?= 3
BIN     := bin
comma   := ,
empty   :=
space   := $(empty) $(empty)

# llama.cpp is compiled by cgo through github.com/ollama/ollama/llama. Its module zip lacks
# three vendored headers: nlohmann/json and stb come from Debian, miniaudio.h from the
# github.com/gen2brain/malgo module, copied into .build/include. Session's cgo shim finds
# llama.h and ggml.h through links in .build/include to the ollama module's own headers.
# -O3 with the machine's vector instructions gives ggml its SIMD; without them decode is
# about 4x slower. PORTABLE=1 builds for a named ISA level instead (x86-64-v3: AVX2 and FMA;
# armv8.2-a on arm64), so one binary runs on a mixed fleet or in a container image.
# AMX stays off on x86-64: -march=native on an Intel CPU with AMX defines __AMX_INT8__, and
# ggml-cpu.cpp then calls the AMX buffer type, whose sources (ggml-cpu/amx/) ollama's cgo
# package never compiles, so every binary would fail to link. scripts/check-cflags.sh
# (run by deps) and a guard in session/llama refuse such flags with a clear message.
INCLUDE := $(CURDIR)/.build/include
ARCH    := $(shell uname -m)
PORTABLE ?=
ifeq ($(ARCH),x86_64)
  NATIVE_ISA   := -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
  PORTABLE_ISA := -march=x86-64-v3 -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
else ifeq ($(ARCH),aarch64)
  NATIVE_ISA   := -mcpu=native
  PORTABLE_ISA := -march=armv8.2-a
else
  NATIVE_ISA   := -march=native
  PORTABLE_ISA :=
endif
ISA := $(if $(PORTABLE),$(PORTABLE_ISA),$(NATIVE_ISA))
export CGO_ENABLED  := 1
export CGO_CPPFLAGS := -I$(INCLUDE)
export CGO_CFLAGS   := -O3 $(ISA)
export CGO_CXXFLAGS := -O3 $(ISA)

# llama.cpp's CPU flash-attention kernel is patched (scripts/ggml-fattn-skip.patch: a unified
# KV pool's cells of other sequences are passed 16 at a time, not read one by one). go build
# cannot overlay files in the module cache, so deps writes a patched copy of the ollama
# module to .build/ollama-patched and .build/go.patched.mod, go.mod with a replace to that
# copy; every go command make runs builds with it (GOFLAGS, inherited by the tests' own
# builds). A plain `go build` outside make builds the stock kernel: the same answers, slower
# with many conversations resident (docs/BENCHMARKS.md, "The kernel patch, built in").
PATCHED_MOD := $(CURDIR)/.build/go.patched.mod
export GOFLAGS := $(strip $(filter-out -modfile=%,$(GOFLAGS)) -modfile=$(PATCHED_MOD))

APT_PACKAGES := nlohmann-json3-dev libstb-dev nftables iproute2 iptables patch
# Only for make test: the dashboard's test drives a real browser.
TEST_APT_PACKAGES := chromium
MALGO        := github.com/gen2brain/malgo@v0.11.24

.PHONY: bench-batch-beside bench-cluster-compare bench-goodput bench-disagg bench-shared-prompt bench-break-even all deps test-deps flags build fuzz bench-portable bench-quant model bench-model test race lint tidy-check bench bench-http bench-cluster bench-overhead bench-compare run chaos autoscale chaos-cleanup chaos-mutants upgrade-check check-clients clean

all: build

# deps: Debian packages (only when missing: headers for the cgo build, nftables and
# iproute2 for network emulation), Go modules, the include folder and the patched module.
# Its own go commands run before the patched go.mod exists, so without GOFLAGS.
deps: .build/deps.stamp $(PATCHED_MOD)
	@sh scripts/check-cflags.sh

.build/deps.stamp: export GOFLAGS :=
.build/deps.stamp: go.mod go.sum
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	$(GO) mod download
	@mkdir -p $(INCLUDE)/miniaudio
	@malgo=$$($(GO) mod download -json $(MALGO) | sed -n 's/.*"Dir": "\(.*\)".*/\1/p'); \
	cp "$$malgo/miniaudio.h" $(INCLUDE)/miniaudio/miniaudio.h; chmod 644 $(INCLUDE)/miniaudio/miniaudio.h
	@ollama=$$($(GO) list -m -f '{{.Dir}}' github.com/ollama/ollama); \
	ln -sfn "$$ollama/llama/llama.cpp/include" $(INCLUDE)/llama; \
	ln -sfn "$$ollama/ml/backend/ggml/ggml/include" $(INCLUDE)/ggml
	@touch $@

$(PATCHED_MOD): export GOFLAGS :=
$(PATCHED_MOD): go.mod go.sum scripts/ggml-fattn-skip.patch .build/deps.stamp
	@rm -rf .build/ollama-patched
	@cp -R "$$($(GO) list -m -f '{{.Dir}}' github.com/ollama/ollama)" .build/ollama-patched
	@chmod -R u+w .build/ollama-patched
	patch -s -p0 -d .build/ollama-patched/ml/backend/ggml/ggml/src/ggml-cpu < scripts/ggml-fattn-skip.patch
	@cp go.sum $(@:.mod=.sum)
	@{ cat go.mod; echo; echo 'replace github.com/ollama/ollama => ./.build/ollama-patched'; } > $@

build: deps
	$(GO) build -o $(BIN)/ ./cmd/...

# flags: the compiler flags the cgo build uses here (PORTABLE=1 for the portable ones).
flags:
	@echo "CGO_CFLAGS=$$CGO_CFLAGS"; echo "CGO_CXXFLAGS=$$CGO_CXXFLAGS"

# model: the default test model (tiny, words vocabulary, ChatML); written only if missing.
model: $(MODEL)
$(MODEL):
	$(GO) run ./cmd/mkmodel -shape tiny -out $@

# bench-model: random weights in SmolLM2-135M's shapes (F16, about 300 MB).
bench-model: $(BENCH_MODEL)
$(BENCH_MODEL):
	$(GO) run ./cmd/mkmodel -shape smollm2-135m -out $@

# Packages run one at a time (-p 1): engine tests and real clusters each want the whole
# machine, and timing-sensitive assertions (drain, cut-off) should not fight each other.
# test-deps: what the tests need beyond the build (only when missing).
test-deps: .build/test-deps.stamp

.build/test-deps.stamp: Makefile
	@missing=$$(for p in $(TEST_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@mkdir -p .build && touch $@

test: deps test-deps model $(BENCH_MODEL)
	INFERNODE_TEST_MODEL=$(CURDIR)/$(MODEL) INFERNODE_BENCH_MODEL=$(CURDIR)/$(BENCH_MODEL) $(GO) test -p 1 -count=1 -timeout 20m ./...

race: deps model
	INFERNODE_TEST_MODEL=$(CURDIR)/$(MODEL) $(GO) test -p 1 -race -count=1 -timeout 30m ./...

# fuzz: every fuzz target for FUZZTIME each (make test runs their seed corpora as tests).
# The node's run without cgo; the engine's need it, and fuzzing instruments llama.cpp's
# build too: the first run compiles it once more (about 9 minutes on 2 cores).
FUZZTIME ?= 30s
FUZZ_PURE := ./node:FuzzChatRequest ./node:FuzzCompletionRequest ./node/hop:FuzzAccept ./node/routing:FuzzMeta
FUZZ_CGO  := ./session:FuzzParseFrame ./session:FuzzChatTemplate
fuzz: deps
	@for t in $(FUZZ_PURE); do pkg=$${t%%:*}; name=$${t##*:}; echo "== $$name ($$pkg, $(FUZZTIME))"; \
		CGO_ENABLED=0 $(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; done
	@for t in $(FUZZ_CGO); do pkg=$${t%%:*}; name=$${t##*:}; echo "== $$name ($$pkg, $(FUZZTIME))"; \
		$(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; done

lint: deps
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	@# staticcheck's package loader refuses -modfile; the Go code it reads is the same.
	GOFLAGS= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...

# chaos-mutants: the short chaos suite against binaries with one KV path or fault handling
# broken on purpose (testbed/mutants/*.patch): each must fail it. Prints the table of
# docs/CHAOS.md; MUTANTS_OUT=dir keeps the logs.
chaos-mutants: deps
	sh scripts/chaos-mutants.sh

# upgrade-check: a rolling upgrade under chat load, from the binary of an earlier commit
# (FROM=commit; default: the newest whose hop minor version differs from this tree's) to
# this tree's. Every answer completes; every follow-up after the last replacement is warm.
FROM ?=
upgrade-check: deps
	sh scripts/upgrade-check.sh $(FROM)

tidy-check: export GOFLAGS :=
tidy-check:
	$(GO) mod tidy && git diff --exit-code go.mod go.sum

# bench: engine benchmarks on the realistic-shape model. BENCHTIME and COUNT as for go test.
BENCHTIME ?= 1x
COUNT     ?= 1
bench: deps bench-model
	INFERNODE_BENCH_MODEL=$(CURDIR)/$(BENCH_MODEL) $(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) -count $(COUNT) -timeout 60m ./session/

# bench-quant: weight types (the realistic shape in F16, then as `infernode quantize` writes
# it in Q8_0, Q4_K_M and Q4_0) and KV cache types (f16, q8_0, q4_0 at 8,192 cells) side by
# side: decode, prefill, size and resident memory (session's BenchmarkQuant).
QUANT_TYPES  ?= q8_0 q4_k_m q4_0
QUANT_MODELS := $(BENCH_MODEL) $(foreach t,$(QUANT_TYPES),$(BENCH_MODEL:.gguf=-$(t).gguf))
$(BENCH_MODEL:.gguf=-%.gguf): $(BENCH_MODEL) | build
	$(BIN)/infernode quantize --type $* $< $@
bench-quant: deps $(QUANT_MODELS)
	INFERNODE_QUANT_MODELS=$(subst $(space),$(comma),$(abspath $(QUANT_MODELS))) $(GO) test -run '^$$' -bench Quant -benchtime $(BENCHTIME) -count $(COUNT) -timeout 60m ./session/

# bench-portable: decode with the native build against the portable one (PORTABLE=1),
# alternating the two test binaries, two rounds. The first run compiles llama.cpp twice.
bench-portable: deps bench-model
	$(GO) test -c -o .build/session-native.test ./session
	CGO_CFLAGS="-O3 $(PORTABLE_ISA)" CGO_CXXFLAGS="-O3 $(PORTABLE_ISA)" $(GO) test -c -o .build/session-portable.test ./session
	cd session && for round in 1 2; do for build in native portable; do echo "$$build, round $$round"; \
		INFERNODE_BENCH_MODEL=$(CURDIR)/$(BENCH_MODEL) ../.build/session-$$build.test -test.run '^$$' \
		-test.bench 'Decode/unified=true/seqs=(1|8)$$' -test.benchtime 3x | grep ^Benchmark; done; done

# bench-cluster: forwarding overhead and routing capacity (fake engines in process, then
# real infernode processes on the default model).
bench-cluster: deps model
	$(GO) test -run '^$$' -bench 'Hop|Routing' -benchtime 2000x ./node/
	INFERNODE_TEST_MODEL=$(CURDIR)/$(MODEL) $(GO) test -run '^$$' -bench HopRealEngine -benchtime 400x ./testbed/

# bench-http: one node on the realistic-shape model, measured through HTTP by loadgen
# (which takes any OpenAI-compatible URL: bin/loadgen --url ...).
BENCH_PORT ?= 18090
bench-http: build bench-model
	@$(BIN)/infernode --model $(BENCH_MODEL) --addr 127.0.0.1:$(BENCH_PORT) --seed 1 --log-level warn & pid=$$!; \
	trap "kill $$pid 2>/dev/null" EXIT; \
	until curl -sf 127.0.0.1:$(BENCH_PORT)/readyz >/dev/null; do kill -0 $$pid || exit 1; sleep 0.2; done; \
	$(BIN)/loadgen --url http://127.0.0.1:$(BENCH_PORT) --concurrency 1,4,8 --rounds 5 --max-tokens 64

# bench-overhead: what the engine and HTTP cost over llama.cpp alone, at 1 and 8 streams:
# the three measured in turn (cmd/benchoverhead), every ratio within one turn.
TURNS ?= 5
bench-overhead: build bench-model
	$(GO) test -c -o .build/llama.test ./session/llama
	$(GO) test -c -o .build/session.test ./session
	$(BIN)/benchoverhead --raw .build/llama.test --engine .build/session.test --model $(BENCH_MODEL) --turns $(TURNS)

# bench-compare: infernode against ollama serve, one node each on the realistic-shape
# model, cmd/loadgen against both, alternating (cmd/benchcompare). ollama is built from
# the module version in go.mod, with the same compiler flags (the exports above).
# ollama is built stock (its own module, without GOFLAGS): the server a user would run.
OLLAMA_VERSION = $(shell GOFLAGS= $(GO) list -m -f '{{.Version}}' github.com/ollama/ollama)
.build/ollama: export GOFLAGS :=
.build/ollama: go.mod | deps
	rm -rf .build/ollama-src && mkdir -p .build/ollama-src
	printf 'module ollamabuild\n\ngo 1.26.0\n\nrequire github.com/ollama/ollama $(OLLAMA_VERSION)\n' > .build/ollama-src/go.mod
	printf 'package main\n\nimport _ "github.com/ollama/ollama/cmd"\n\nfunc main() {}\n' > .build/ollama-src/main.go
	cd .build/ollama-src && $(GO) mod tidy && $(GO) build -o ../ollama github.com/ollama/ollama

# bench-disagg: decoding streams beside bursts of long new prompts on two nodes pinned to
# a core each, co-located (both nodes prefill and decode) against split (--role decode and
# --role prefill): inter-token p50/p99 and the bursts' first token (testbed's
# BenchmarkDisagg; docs/BENCHMARKS.md).
bench-disagg: deps bench-model
	INFERNODE_BENCH_MODEL=$(CURDIR)/$(BENCH_MODEL) $(GO) test -run '^$$' -bench Disagg -benchtime 1x -count $(COUNT) -timeout 30m ./testbed/

# bench-shared-prompt: 30 conversations that begin with one ~1,000-token system prompt,
# over 3 nodes with prefix digests and without, against one node alone: the prompt's
# prefills in the whole cluster and the first turns' first token (testbed's
# BenchmarkSharedPrompt; docs/BENCHMARKS.md).
bench-shared-prompt: deps bench-model
	INFERNODE_BENCH_MODEL=$(CURDIR)/$(BENCH_MODEL) $(GO) test -run '^$$' -bench SharedPrompt -benchtime 1x -count $(COUNT) -timeout 30m ./testbed/

# bench-break-even: transfer or recompute, predicted against measured, at 100, 1,000 and
# 8,000 prompt tokens on links capped at 20, 100 and 1,000 Mbit/s (testbed's
# BenchmarkBreakEven; network namespaces: root).
bench-break-even: deps bench-model
	INFERNODE_BENCH_MODEL=$(CURDIR)/$(BENCH_MODEL) $(GO) test -run '^$$' -bench BreakEven -benchtime 1x -count $(COUNT) -timeout 60m ./testbed/

# bench-batch-beside: interactive first tokens on one node (stories260K from ../shared)
# alone and beside batch clients, on a core of its own and under the autoscale scenario's
# CPU quota (testbed's BenchmarkBatchBeside: the node on CPU 0, the benchmark on CPU 1).
bench-batch-beside: deps
	taskset -c 1 $(GO) test -run '^$$' -bench BatchBeside -benchtime 300x -count $(COUNT) -timeout 30m ./testbed/

# ROUNDS alternations of the servers; the wave targets are medians over at least 4.
ROUNDS ?= 4
bench-compare: build bench-model .build/ollama
	$(BIN)/benchcompare --ollama .build/ollama --model $(BENCH_MODEL) --rounds $(ROUNDS)

# bench-goodput: bench-compare's goodput mode: open-loop load swept over RATES (each for
# RATE_DURATION) against both servers, SLOs from llama.cpp alone (BenchmarkRawFirstToken)
# at 1x, 2x and 4x, goodput at 90% attainment. Sampled at temperature 1: greedy, the
# benchmark model's random weights loop and ollama cuts such answers short (see
# docs/BENCHMARKS.md, "ollama's failed answers: its repeat guard on a looping model").
# INFERNODE_ARGS adds infernode flags (--kv-unified=false --ctx 16384 --flash-attn=false).
RATES ?= 0.25,0.5,1,1.5,2,3
RATE_DURATION ?= 60s
bench-goodput: build bench-model .build/ollama
	$(GO) test -c -o .build/llama.test ./session/llama
	$(BIN)/benchcompare --ollama .build/ollama --model $(BENCH_MODEL) --rounds $(or $(GOODPUT_ROUNDS),2) \
		--goodput .build/llama.test --rates $(RATES) --rate-duration $(RATE_DURATION) --temperature 1 \
		--infernode-args "$(INFERNODE_ARGS)"

# bench-cluster-compare: CLUSTER_NODES infernode nodes against as many ollama servers behind
# nginx (round robin, and consistent hash on the session header), each backend pinned to a
# core; open-loop multi-turn load swept over CLUSTER_RATES, then one backend SIGKILLed
# mid-run (cmd/benchcluster; nginx.conf.tmpl there is the configuration). nginx comes from
# the distribution's packages, installed here if missing. CLUSTER_ARGS adds benchcluster flags
# (--kill-duration, --kill-rate, --kill-seed, --parallel, --ctx, --ollama-num-ctx,
# --temperature; --infernode-b-args '--place-margin 0' for an A/B of infernode's flags in
# the same run).
CLUSTER_NODES ?= 2
CLUSTER_RATES ?= 0.5,1,1.5,2
CLUSTER_RATE_DURATION ?= 45s
bench-cluster-compare: build bench-model .build/ollama
	@command -v nginx >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null; }
	$(GO) test -c -o .build/llama.test ./session/llama
	$(BIN)/benchcluster --ollama .build/ollama --raw .build/llama.test --model $(BENCH_MODEL) --nodes $(CLUSTER_NODES) \
		--rates $(CLUSTER_RATES) --rounds $(or $(CLUSTER_ROUNDS),2) --rate-duration $(CLUSTER_RATE_DURATION) $(CLUSTER_ARGS)

# run: a local cluster of NODES nodes (HTTP 127.0.0.1:8081.., gossip 7947..), every node
# joining through the first; Ctrl-C stops them all. MODELS=a.gguf,b.gguf makes a cluster
# of several models: node i serves the i-th, round robin. LIMITS=1 gives the nodes the
# example tenants and limits of deploy/examples (keys and limits); ARGS adds flags to
# every node.
MODELS ?=
LIMITS ?=
ARGS ?=
RUN_ARGS = $(if $(LIMITS),--api-key key-of-the-operator-0001 --node-args "--key-file deploy/examples/keys --limits deploy/examples/limits $(ARGS)",--node-args "$(ARGS)")
run: build model
	$(BIN)/testbed run --binary $(BIN)/infernode --model $(MODEL) --models "$(MODELS)" --nodes $(NODES) --log-dir .build/logs $(RUN_ARGS)

# check-clients: the Vercel AI SDK, the OpenAI SDK and LangChain, unchanged, against a
# 3-node cluster on a real model (scripts/clients/check.mjs); needs node and npm.
CLIENTS_MODEL ?= ../shared/models/stories260K.gguf
check-clients: build
	scripts/check-clients.sh $(BIN) $(CLIENTS_MODEL)

# chaos: the long chaos suite (5 nodes in network namespaces, every fault type,
# overlapping) on a real model, every answer compared with a reference; needs root.
# Reports and node logs go to .build/chaos.
CHAOS_MODEL ?= ../shared/models/stories260K.gguf
chaos: build
	$(BIN)/testbed chaos --suite long --binary $(BIN)/infernode --model $(CHAOS_MODEL) --out .build/chaos

# autoscale: the autoscaling scenario (a load ramp from 0.5x to 4x one node's capacity
# and back; the scale hook starts and stops real nodes held to a share of one CPU, about
# 10.5 minutes). Report and timeline plot go to .build/autoscale.
autoscale: build
	$(BIN)/testbed autoscale --binary $(BIN)/infernode --model $(CHAOS_MODEL) --out .build/autoscale

# chaos-cleanup: remove namespaces and links a killed chaos run left behind.
chaos-cleanup: build
	$(BIN)/testbed cleanup

clean:
	rm -rf $(BIN) .build models
