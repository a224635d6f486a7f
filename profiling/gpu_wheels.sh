#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks (it has no network): kvxfer's runtime
# deps that its image does not carry (pyzmq, msgspec, the nvtx Python package: its nvidia-nvtx is only the C library). They land in .whl/ (git-ignored), which the device tool
# carries; profiling/gpu_validate.sh installs them there. Python 3.12, x86-64 (the GPU image).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl pyzmq msgspec nvtx
ls -la .whl
