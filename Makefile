# The two commands a fresh clone needs: `make demo` (the main job on embedded defaults) and
# `make test` (the whole suite). Both create .venv with Python 3.12 when it is missing.
PYTHON ?= $(shell ./.ci/find-python)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast check lint format typecheck imports bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,otel,console]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/relayr demo

check: lint typecheck imports

lint: $(STAMP)
	$(BIN)/ruff check relayr tasks rules tests bench
	$(BIN)/ruff format --check relayr tasks rules tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# the layers (pyproject.toml's [tool.importlinter]): relayr.cli alone composes the engine with tasks
imports: $(STAMP)
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format relayr tasks rules tests bench
	$(BIN)/ruff check --fix relayr tasks rules tests bench

# the whole suite, a test module per xdist process: four of them on the 2-core machine, since a
# worker test spends much of its time waiting on its processes' leases and back-offs, and two
# left a core idle then (ADR-0123); each test makes its own queue, database, folder and ports,
# so modules run side by side; the costliest modules first, in the order the tests' conftest.py
# sorts them (ADR-0132)
test: check
	$(BIN)/pytest -n 4 --dist loadfile --no-loadscope-reorder --durations=40

# the tests write Python's bytecode even where the environment says not to: the suite starts
# some 500 Python processes (workers, dispatchers, consoles, commands), and each would compile
# relayr's modules again, about 0.2 s of CPU apiece
test test-fast: export PYTHONDONTWRITEBYTECODE =

# a developer's loop: the tests that start no process and need no server (README), a module per
# xdist process: three of them on the 2-core machine, since some of these tests wait for a lease
# to lapse or a back-off to pass, and two left a core idle then (ADR-0130)
test-fast: $(STAMP)
	$(BIN)/pytest -m "not worker and not process and not slow and not postgres and not redis" -n 3 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(BIN)/python -m bench.targets
	$(BIN)/python -m bench.latency
	$(BIN)/python -m bench.fairness
	$(BIN)/python -m bench.idle
	$(BIN)/python -m bench.broker
	$(BIN)/python -m bench.fair_queue
	$(BIN)/python -m bench.cli
	$(BIN)/python -m bench.console

clean:
	rm -rf $(VENV) .relayr .pytest_cache .mypy_cache .ruff_cache .hypothesis
