#!/usr/bin/env bash
# A rehearsal of issue 49's GPU run on this machine's CPU, in an environment like the GPU
# machine's: a venv with its torch (2.11) and transformers (5.17) and none of classgrad's other
# dependencies but the ones that machine's image holds, then the carried wheels
# (scripts/gpu_wheels.sh, for this Python) and scripts/gpu_proof.sh itself with
# `--device cpu --quick`. It catches what the repo's own venv cannot: a wheel missing from the
# carried list, an import of Ray or of a test-only package, an API newer than the machine's torch.
# Python is this machine's 3.11 (the GPU machine's is 3.12). About 2 minutes once the venv exists.
#   bash scripts/gpu_rehearsal.sh [OUT_DIR]          # default /tmp/classgrad-gpu-rehearsal/out
set -euo pipefail
cd "$(dirname "$0")/.."
root=/tmp/classgrad-gpu-rehearsal
venv=$root/venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# The GPU machine's versions (/work/.library/device/KINDS.md), and of the packages that image holds
# only those the proof imports; torch 2.11 wants setuptools below 82. Quick once they are there.
"$venv/bin/python" -m pip install -q torch==2.11.0 transformers==5.17.0 "setuptools>=68,<82" wheel \
    numpy pyyaml tqdm safetensors psutil fsspec packaging typing-extensions xarray pytest pytest-timeout \
    2> >(grep -v "^WARNING: Location" >&2)
bash scripts/gpu_wheels.sh "$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" \
    "$root/wheels" > /dev/null
OUT=${1:-$root/out} PYTHON=$venv/bin/python WHEELS=$root/wheels SITE=$root/site \
    bash scripts/gpu_proof.sh --device cpu --quick
