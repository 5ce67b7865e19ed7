# The two commands in the README: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo test unit integration bench clean

setup:
	bash scripts/bootstrap.sh

demo: setup
	.venv/bin/classgrad run configs/demo.yaml

test: setup
	$(PY) -m pytest -q tests

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf .venv stores benchmarks/out
