#!/usr/bin/env bash
# Issue 49's one command, on the lent GPU machine (Python 3.12, torch with CUDA, transformers and
# xarray; no zarr, pydantic or Ray): installs the wheels carried in .whl/ (made here by
# scripts/gpu_wheels.sh), then runs benchmarks/gpu_proof.py into OUT (default $OUT, the device
# tool's folder that comes back), stopped at 8 minutes. Extra arguments go to gpu_proof.py.
#   bash scripts/gpu_proof.sh                      # on the GPU machine
#   .venv/bin/python -m benchmarks.gpu_proof --device cpu --quick --out /tmp/gp   # CPU smoke run, here
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/out/gpu_proof}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out.nvidia-smi.txt" 2>&1 || true
timeout 480 python3 -m benchmarks.gpu_proof --out "$out" "$@"
