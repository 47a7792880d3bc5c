# Set-up and checks on a fresh machine: `make run` (the main job) and `make test` (the suite).
# The venv also gets the Helm binary the chart tests run (deploy/tools/fetch_helm.py).
# TORCH is installed before the project so its range (torch>=2.4) is already met: on these
# CPU machines torch==2.13.0 is a CPU wheel on local disk; on a GPU host the same pin from
# PyPI is the CUDA build (or set TORCH= to keep a torch you already have).
PY     ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: run test gpu-test proto clean

$(STAMP): pyproject.toml deploy/tools/fetch_helm.py
	$(PY) -m venv $(VENV)
	$(if $(TORCH),$(BIN)/pip install -q "$(TORCH)")
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/python deploy/tools/fetch_helm.py $(BIN)
	touch $@

# The main job: the gRPC service on the embedded default model (local Ray, 127.0.0.1:50051).
# Beside it:  .venv/bin/tinyloop generate --server 127.0.0.1:50051 --prompt "def fibonacci(n):" --loops 8
run: $(STAMP)
	$(BIN)/tinyloop serve

# Regenerate the stubs of proto/tinyloop/v1/tinyloop.proto (the client) and
# proto/tinyloop/worker/v1/channel.proto (the worker channel); a test fails when they are stale.
proto: $(STAMP)
	$(BIN)/python proto/generate.py

# the slowest tests are listed after the run: the suite has to stay well inside CI's time
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=30

gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info
