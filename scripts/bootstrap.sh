#!/usr/bin/env bash
# Creates (or refreshes) .venv with the pinned environment from requirements/lock.txt and
# installs classgrad into it in editable mode. Idempotent: a stamp of the inputs skips the work
# when nothing changed. Used by `make demo`, `make test` and CI.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin=${PYTHON:-python3}
venv=.venv
stamp=$venv/.bootstrap-stamp
inputs_hash=$(cat requirements/lock.txt pyproject.toml | sha256sum | cut -d' ' -f1)

if [[ -f $stamp && $(cat "$stamp") == "$inputs_hash" ]]; then
    exit 0
fi

echo "bootstrap: creating $venv with $($python_bin --version)" >&2
"$python_bin" -m venv "$venv"
# The lock pins torch to the CPU wheel so that tests never pull a multi-GB CUDA build.
"$venv/bin/pip" install --quiet --disable-pip-version-check -r requirements/lock.txt
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e .
echo "$inputs_hash" > "$stamp"
echo "bootstrap: done" >&2
