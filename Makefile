# Motor: `make run` starts a local cluster on the simulated engine; `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup run test proto proto-check lint bench clean

setup:
	@bash scripts/setup-venv.sh

run: setup
	$(VENV)/bin/motorctl up --nodes 2 --deployment examples/local-deployment.yaml

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerate the Python API (messages, gRPC stubs, type stubs) from proto/.
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. proto/motor/v1/*.proto

lint: setup
	$(VENV)/bin/buf lint

clean:
	rm -rf $(VENV) .pytest_cache engine_server_log .run
