#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks (it has no network): kvxfer's runtime
# deps that its image does not carry (pyzmq, msgspec, the nvtx Python package: its nvidia-nvtx is
# only the C library), and NIXL (slimmed). transformers, for profiling/model_check.py, is in the
# image. They land in .whl/ (git-ignored), which the device tool carries; profiling/gpu_validate.sh
# installs them there. Python 3.12, x86-64 (the GPU image).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl pyzmq msgspec nvtx
# NIXL for the nixl transport on the GPU (issue 42 step 6): its wheel (~56 MiB) repacked with only what
# the transport loads (~17 MiB: profiling/slim_nixl_wheel.py), so the tree and the wheels stay under
# the 64 MiB a device call carries; the full wheel is kept outside .whl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl nixl-cu13==1.5.1
python3 profiling/slim_nixl_wheel.py .whl/nixl_cu13-1.5.1-cp312-*.whl --keep-full "${TMPDIR:-/tmp}"
ls -la .whl
