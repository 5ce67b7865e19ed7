#!/usr/bin/env bash
# Issue 49's one command, on the lent GPU machine (Python 3.12, torch with CUDA, transformers and
# xarray; no zarr, pydantic or Ray): installs the wheels carried in .whl/ (made here by
# scripts/gpu_wheels.sh) and classgrad from this working tree, then runs benchmarks/gpu_proof.py
# into OUT (default $OUT, the device tool's folder that comes back), stopped at 8 minutes. Extra
# arguments go to gpu_proof.py (a rerun of some sections: --sections exact,scaler).
#   bash scripts/gpu_proof.sh                      # on the GPU machine
#   bash scripts/gpu_rehearsal.sh                  # here: the same command in a venv like the machine's, on the CPU
# PYTHON, WHEELS and SITE name the interpreter, the wheel folder and the install folder (the rehearsal sets them).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/out/gpu_proof}
python=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/site}
rm -rf "$site"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
# From the tree, not a wheel built earlier: what runs is what is checked out. The build writes its
# scratch folders to a copy, so the tree stays as it was.
build=$(mktemp -d)
cp -r pyproject.toml README.md src workers service "$build"/
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --target "$site" "$build"
rm -rf "$build"
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"  # nvidia-smi's answer goes inside it: only files under $OUT come back
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia-smi.txt" 2>&1 || true
# SIGTERM at 8 minutes (gpu_proof records the section it cut and writes its report), SIGKILL 15 s later.
timeout -k 15 480 "$python" -m benchmarks.gpu_proof --out "$out" "$@"
