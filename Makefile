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

# The integration tests in two processes (CI's 2 cores), a file per process at a time (module
# fixtures such as a local Ray stay in one process): they wait on Ray and subprocesses much of
# the time (measured on 2 cores: 21 min in one process, 16 min in two). The unit tests are
# CPU-bound and run in one (3 min; 5 min in two, their torch threads contending).
INTEGRATION := $(PY) -m pytest -q -n 2 --dist loadfile tests/integration

test: setup lint
	$(PY) -m pytest -q tests/unit
	$(INTEGRATION)

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(INTEGRATION)

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf .venv stores benchmarks/out
