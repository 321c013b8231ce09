# The two set-up commands: `make run` and `make test`. Both create .venv and install
# the project into it on first use (pip takes torch and torchvision from the machine's disk).
# `make lint` runs ruff and mypy (before `make test` in .ci/run).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test test-fast lint bench install clean-runs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Main job on the embedded default (SQLite + files under runs/, no server).
run: $(STAMP)
	$(BIN)/sweeps run studies/lr_bs.yaml

# Two test processes (pytest-xdist): the suite keeps two cores over 90% busy (README gives the
# figures). TEST_PROCESSES=0 runs them in one.
TEST_PROCESSES ?= 2
# pytest keeps each test module's assertion-rewritten bytecode in __pycache__ (git ignores it), so
# a later run's test processes load it instead of rewriting every module again; an environment
# with PYTHONDONTWRITEBYTECODE set would forbid that, so the test targets clear it (for the
# processes the tests start too, which keep the project's bytecode there as well).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

test: $(STAMP)
	$(PYTEST) -n $(TEST_PROCESSES) --dist worksteal

# The fast tier: everything but the tests marked slow (studies through `sweeps run`, other heavy
# subprocesses), ray, browser (Chromium), postgres or slurm; about 1.5 CPU-minutes of test processes
# (README gives the measured figure). A test of this tier that starts a study fails and asks for
# the slow marker (tests/conftest.py).
FAST_TIER := not slow and not ray and not browser and not postgres and not slurm

test-fast: $(STAMP)
	$(PYTEST) -n $(TEST_PROCESSES) --dist worksteal -m "$(FAST_TIER)"

# Static checks: ruff (rules in pyproject.toml [tool.ruff]), mypy ([tool.mypy]: core, sweeps,
# dashboards) and import-linter's contracts ([tool.importlinter]: the layers, the backends apart).
# About a minute on 2 cores, most of it mypy's first run (.mypy_cache after that).
lint: $(STAMP)
	$(BIN)/ruff check core sweeps dashboards benchmarks scripts tests
	$(BIN)/mypy
	PYTHONPATH=. $(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

clean-runs:
	rm -rf runs
