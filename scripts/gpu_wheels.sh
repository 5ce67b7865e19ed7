#!/usr/bin/env bash
# Fills a wheel folder (default .whl/, git-ignored through .git/info/exclude) with what the lent GPU
# machine lacks, for its Python (default 3.12): the pinned versions (requirements/lock.txt) of
# zarr and everything zarr needs that the machine's image does not hold (numcodecs, crc32c,
# google-crc32c, donfig), pydantic and its parts, and the digests' xxhash. classgrad itself is
# not carried as a wheel: scripts/gpu_proof.sh installs it from the working tree, so a fix made
# between two runs is what runs. Ray is not carried (too large; the proof needs no Ray).
#   bash scripts/gpu_wheels.sh                       # then the device tool: carry [".whl"], `bash scripts/gpu_proof.sh`
#   bash scripts/gpu_wheels.sh 3.11 /tmp/wheels      # this machine's Python (scripts/gpu_rehearsal.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
dest=${2:-.whl}
if [ "$dest" = .whl ]; then
    grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
fi
rm -rf "$dest" && mkdir -p "$dest"
names=(zarr numcodecs crc32c google-crc32c donfig pydantic pydantic_core annotated-types typing-inspection xxhash)
pins=()
for name in "${names[@]}"; do
    pins+=("$(grep -iE "^${name}==" requirements/lock.txt)")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp "${platforms[@]}" -d "$dest" "${pins[@]}"
ls -l "$dest"
