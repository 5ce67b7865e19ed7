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

test: setup lint
	$(PY) -m pytest -q tests

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf .venv stores benchmarks/out
