#!/usr/bin/env bash
# Fills .whl/ (git-ignored through .git/info/exclude) with what the lent GPU machine lacks, for its
# Python 3.12: classgrad's own wheel (built here) and the pinned versions (requirements/lock.txt)
# of zarr and its codecs, pydantic and the digests' xxhash. Ray is not carried (too large; the
# proof needs no Ray). Then: the device tool's run, carry [".whl"], command `bash scripts/gpu_proof.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
names=(zarr numcodecs crc32c donfig pydantic pydantic_core annotated-types typing-inspection xxhash)
pins=()
for name in "${names[@]}"; do
    pins+=("$(grep -iE "^${name}==" requirements/lock.txt)")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
.venv/bin/python -m pip wheel --quiet --no-deps --no-build-isolation -w .whl .
ls -l .whl
