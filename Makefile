# Every entry point of moe-lora-serve. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build on machines without a GPU (CI has this wheel on disk); GPU nodes
# bring their own CUDA build: `make setup TORCH_SPEC=` skips installing torch.
TORCH_SPEC ?= torch==2.13.0
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
# Prometheus and promtool (the Debian package, unpacked without root): the tests scrape live
# services with it and check the chart's dashboard queries and alert rules.
PROMETHEUS_DEB := prometheus_2.42.0+ds-5+deb12u1_amd64.deb
PROMETHEUS_SHA256 := 81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55
PROMTOOL := .tools/prometheus/usr/bin/promtool
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/moelora/v1/*.proto)
PYTEST_ARGS ?=

.PHONY: help setup client-wheel proto proto-check lint docs format test demo bench bench-registry bench-load bench-forward bench-decode bench-engine-loop bench-frontends \
	helm-check fuzz chaos soak clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

setup: $(STAMP) $(BUF) $(PROMTOOL) ## Create .venv with the pinned dependencies, buf and Prometheus

# The client wheel's dependencies, kept as wheels: its test installs it into a fresh venv offline.
CLIENT_DEPS := grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.36.2 numpy==2.3.5

$(STAMP): pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip==26.3
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"; fi
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[registry,executor,transformers,dev]'
	$(PY) -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
		--dest $(VENV)/wheelhouse $(CLIENT_DEPS)
	touch $@

$(BUF):
	mkdir -p .tools
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION)

# apt's own download where its package lists are present, else the pinned file from the mirror.
$(PROMTOOL):
	rm -rf .tools/prometheus .tools/deb && mkdir -p .tools/deb
	cd .tools/deb && { apt-get download prometheus 2>/dev/null || { \
		curl -fsSLO "https://deb.debian.org/debian/pool/main/p/prometheus/$(PROMETHEUS_DEB)" && \
		echo "$(PROMETHEUS_SHA256)  $(PROMETHEUS_DEB)" | sha256sum --check --quiet; }; }
	dpkg-deb --extract .tools/deb/prometheus_*.deb .tools/prometheus
	rm -rf .tools/deb

client-wheel: $(STAMP) ## Build the moelora-client wheel (the moelora namespace only) into dist/
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation ./client --wheel-dir dist

proto: $(STAMP) ## Regenerate the Python stubs from protos/
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m grpc_tools.protoc -Iprotos \
		--python_out=protos --grpc_python_out=protos \
		--mypy_out=quiet:protos --mypy_grpc_out=quiet:protos $(PROTO_SRC)

proto-check: $(STAMP) ## Fail if the committed stubs differ from freshly generated ones
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m grpc_tools.protoc -Iprotos \
		--python_out=$$tmp --grpc_python_out=$$tmp \
		--mypy_out=quiet:$$tmp --mypy_grpc_out=quiet:$$tmp $(PROTO_SRC) && \
	for f in $$(cd $$tmp && find . -type f); do \
		cmp -s $$tmp/$$f protos/$$f || { echo "stale stub: protos/$$f (run make proto)"; exit 1; }; \
	done && echo "stubs are in sync"

lint: setup proto-check ## ruff, mypy, import contracts (layers), buf lint, stub freshness
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(BUF) lint

docs: $(STAMP) ## Regenerate docs/configuration.md from the settings classes
	$(PY) -m docs.generate_configuration

format: $(STAMP) ## Apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: setup ## Run every test (GPU tests skip without a GPU, PostgreSQL tests without MOELORA_TEST_POSTGRES_URL)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup ## Registry + executor on embedded defaults: upload adapters, call Forward
	$(PY) -m demo.run

bench: setup ## Kernel benchmark on a GPU: correctness at real shapes, then the table
	$(PY) -m kernels.bench

bench-registry: setup ## Registry upload/download throughput, 1 GB adapter, local dir and S3 (moto)
	$(PY) -m registry_service.bench

bench-load: setup ## Adapter cold start, 1.26 GB: cold/disk/host warm (ARGS=--device cuda)
	$(PY) -m executor_service.bench.load $(ARGS)

bench-forward: setup ## Forward as a client sees it: p50/p99, transport floor, tokens/s (GPU)
	$(PY) -m executor_service.bench.forward

bench-decode: setup ## Greedy decoding with remote MoE blocks vs in process: ms per token (GPU)
	$(PY) -m executor_service.bench.decode $(ARGS)

bench-engine-loop: setup ## The engine's launch loop alone: requests/s and its CPU per request (no GPU)
	$(PY) -m executor_service.bench.engine_loop $(ARGS)

bench-frontends: setup ## The gRPC front ends alone: their CPU per call against the echo floor (no GPU)
	$(PY) -m executor_service.bench.frontends $(ARGS)

fuzz: setup ## Full fuzz run: property tests, >= 1,000 mutated Forward, >= 300 uploads, the hostile-client attacks (figures printed)
	$(PY) -m pytest tests/fuzz tests/hostile --long -s -q $(PYTEST_ARGS)

chaos: setup ## Fault suite: S3 faults behind a proxy, SIGKILLed servers, damaged and full disk caches
	$(PY) -m pytest tests/chaos --long -q $(PYTEST_ARGS)

soak: setup ## Soak: 32 client processes x 64 adapters through 8 slots, >= 10,000 Forward calls (figures printed)
	$(PY) -m pytest tests/soak --long -s -q $(PYTEST_ARGS)

helm-check: setup ## Render, lint and validate the Helm chart
	$(PY) -m pytest tests/helm $(PYTEST_ARGS)

clean: ## Remove the virtual environment, tools and caches
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache
