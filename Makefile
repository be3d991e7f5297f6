# Motor: `make run` starts a local cluster on the simulated engine (`make run-vllm`: on the real
# vLLM engine, this machine's CPU); `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup setup-run setup-fast run run-vllm test test-fast mutation proto proto-check lint format bench clean

# Everything: Motor, torch and the vLLM CPU build, the test and build tools (a few minutes the first time).
setup:
	@bash scripts/setup-venv.sh

# Only what the simulated cluster needs (no torch, no vLLM): under a minute on a fresh machine.
setup-run:
	@bash scripts/setup-venv.sh run

# What the simulated cluster and the fast tier need (still no torch, no vLLM).
setup-fast:
	@bash scripts/setup-venv.sh fast

# The local cluster. Both cluster targets take the same knobs: PORT (the front door's OpenAI port,
# default 8080), CONTROLLER_PORT (50051), METRICS_PORT (the controller's /metrics, 9471), RUN_DIR
# (.run), NODES, DEPLOYMENT and RUN_ARGS (more `motorctl up` flags); empty ones keep motorctl up's
# defaults. A variable on the command line that the target does not take is refused, not ignored.
CLUSTER_KNOBS := PORT CONTROLLER_PORT METRICS_PORT RUN_DIR NODES DEPLOYMENT RUN_ARGS
UP_FLAGS = $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(if $(PORT),--router-port $(PORT)) \
	$(if $(CONTROLLER_PORT),--controller-port $(CONTROLLER_PORT)) $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT)) \
	$(RUN_ARGS)
RUN_SIM = $(VENV)/bin/motorctl up --nodes $(or $(NODES),2) --deployment $(or $(DEPLOYMENT),examples/local-deployment.yaml)
run: setup-run
	$(RUN_SIM) $(UP_FLAGS)

# The real vLLM engine (its CPU build) behind the router on this machine: a tiny random-weight
# Llama made locally (no model hub; examples/vllm-tiny.yaml expects it in TINY_MODELS), one node
# manager handing each engine its own CPU cores. docs/vllm.md.
TINY_MODELS := /tmp/motor-models
RUN_VLLM = $(VENV)/bin/motorctl up --nodes $(or $(NODES),1) --accelerator-type cpu --model-root $(TINY_MODELS) \
	--deployment $(or $(DEPLOYMENT),examples/vllm-tiny.yaml)
run-vllm: setup
	$(VENV)/bin/motorctl tiny-model $(TINY_MODELS)/tiny-llama
	HF_HUB_OFFLINE=1 $(RUN_VLLM) $(UP_FLAGS)

# Variables given on the command line (`make run PROT=1`): each must be a knob of the goal.
GIVEN := $(foreach name,$(.VARIABLES),$(if $(filter command line,$(origin $(name))),$(name)))
ifneq ($(filter run run-vllm,$(MAKECMDGOALS)),)
NOT_TAKEN := $(filter-out $(CLUSTER_KNOBS) VENV PYTEST_ARGS,$(GIVEN))
ifneq ($(NOT_TAKEN),)
$(error $(firstword $(filter run run-vllm,$(MAKECMDGOALS))) does not take $(NOT_TAKEN): its knobs are \
	$(CLUSTER_KNOBS) (docs/local-cluster.md); other `motorctl up` flags go in RUN_ARGS='--flag value')
endif
endif

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The inner loop while coding: every test that starts no real process (no service, engine, vLLM,
# etcd or docker) and takes no more than a few seconds, four at a time (most wait on timers, not the
# CPU). A test here that starts a process fails, naming the mark it needs.
test-fast: setup-fast
	MOTOR_FAST_TIER=1 $(PY) -m pytest -q -n 4 -m "not processes and not vllm and not docker and not slow" $(PYTEST_ARGS)

# Mutation testing of the policy modules (pyproject.toml [tool.mutmut]); prints the score and fails
# under 90% or on a surviving mutant that tests/mutation/equivalent.md does not explain.
mutation: setup
	rm -rf mutants
	$(PY) -m mutmut run >mutants.log 2>&1 || { tail -50 mutants.log; exit 1; }
	$(PY) scripts/mutation_score.py

# Regenerate the Python API (messages, gRPC stubs, type stubs) from proto/.
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. proto/motor/v1/*.proto

# Ruff's rules and formatting (pyproject.toml [tool.ruff]), the layers and the absence of import cycles
# (pyproject.toml [tool.importlinter], docs/design.md), the code's sizes (scripts/check_sizes.py) and
# buf's rules for proto/. `make format` mends ruff's.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_sizes.py
	$(VENV)/bin/buf lint

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache engine_server_log .run mutants mutants.log

# The compose simulation (docs/compose.md): `docker compose` v2 when installed, else docker-compose v1.
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
export COMPOSE_PROJECT_NAME ?= motor

.PHONY: compose-up compose-offline-up compose-down compose-test clients

# Needs a registry for the python:3.11-slim base image.
compose-up: setup
	bash scripts/build-wheelhouse.sh
	$(COMPOSE) up -d --build

# No registry, no network in containers (as root): local dockerd, a debootstrap base image, wheels.
compose-offline-up: setup
	bash scripts/docker-engine.sh
	bash scripts/build-base-image.sh motor-base:bookworm
	DEBIAN_PACKAGES=prometheus bash scripts/build-base-image.sh motor-prometheus:bookworm
	DEBIAN_PACKAGES=etcd-server,etcd-client bash scripts/build-base-image.sh motor-etcd:bookworm
	bash scripts/build-wheelhouse.sh
	MOTOR_BASE_IMAGE=motor-base:bookworm MOTOR_PROMETHEUS_IMAGE=motor-prometheus:bookworm \
	  MOTOR_ETCD_IMAGE=motor-etcd:bookworm $(COMPOSE) up -d --build

compose-down:
	$(COMPOSE) down --volumes --remove-orphans

compose-test: setup
	bash scripts/docker-engine.sh
	$(PY) -m pytest tests/compose -m docker $(PYTEST_ARGS)

# Build the Go example client (examples/go-client/bin/motor-go-client).
clients:
	bash examples/go-client/build.sh
