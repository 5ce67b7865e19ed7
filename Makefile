# The two commands in the README: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo lint test unit integration bench clean

setup:
	bash scripts/bootstrap.sh

demo: setup
	.venv/bin/classgrad run configs/demo.yaml

# ruff (lint and format) and mypy, with zero errors: part of the test command CI runs.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	$(PY) scripts/typecheck.py

# Both suites in two processes (CI's 2 cores), each process with one torch thread
# (tests/conftest.py): the unit tests take 1 min 37 s so, 3 min in one process (and 5 min in two
# with two threads each, contending). The integration tests go a file per process at a time
# (module fixtures such as a local Ray stay in one process): they wait on Ray and subprocesses
# much of the time. benchmarks/RESULTS.md, "The suite under load", has the figures.
UNIT := $(PY) -m pytest -q -n 2 tests/unit
INTEGRATION := $(PY) -m pytest -q -n 2 --dist loadfile tests/integration

test: setup lint
	$(UNIT)
	$(INTEGRATION)

unit: setup
	$(UNIT)

integration: setup
	$(INTEGRATION)

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf .venv stores benchmarks/out
