# The two commands a newcomer runs: `make demo` and `make test`. Each builds what is
# missing (the venvs, keyed on a hash of what they install) and then runs.
SHELL := /bin/bash
VENV := .venv
PYTEST_ARGS ?=

# Prefect offline and project-local: no analytics, its home (SQLite DB, settings) in the tree.
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export HF_HUB_OFFLINE ?= 1

.PHONY: demo test test-speculators venv venv-vllm venv-speculators clean-venvs ui ui-stop

venv:
	@scripts/ensure_venv.sh pipeline

venv-vllm:
	@scripts/ensure_venv.sh vllm

## make demo: the whole pipeline (the stages built so far) on the embedded defaults.
demo: venv venv-vllm
	@$(VENV)/bin/eagle3 run $(ARGS)

## make test: the test suite.
test: venv venv-vllm
	@scripts/ensure_chromium.sh
	@$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

## make test-speculators: our speculators export loaded by vllm-project/speculators itself. Optional,
## not part of `make test`: it builds its own .venv-speculators (CPU torch, ~2 GB, a few minutes once).
venv-speculators:
	@scripts/ensure_speculators_venv.sh

test-speculators: venv venv-speculators
	@$(VENV)/bin/python -m pytest tests/integration/test_speculators_lib.py $(PYTEST_ARGS)

## make ui: a Prefect server with the UI, the deployments registered and a worker; prints the URL.
ui: venv venv-vllm
	@scripts/ui.sh

ui-stop:
	@scripts/ui.sh stop

clean-venvs:
	rm -rf .venv .venv-vllm .venv-speculators
