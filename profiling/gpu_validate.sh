#!/usr/bin/env bash
# Validate kvxfer on a lent GPU machine: every test (GPU-marked ones included), then the
# benchmark sweeps; raw logs, JSON and PNGs go to $OUT (or profiling/results/<date>-<gpu>/).
#
# Here:    bash profiling/gpu_wheels.sh            # once: fetch wheels the GPU image lacks
# Device:  run(command="bash profiling/gpu_validate.sh tests", carry=[".whl"])
#          run(command="bash profiling/gpu_validate.sh ops --models llama3-8b", carry=[".whl"])
#          run(command="bash profiling/gpu_validate.sh transfer", carry=[".whl"])
# Each step fits one device command (10 minutes); run them on one warm machine.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
step=${1:-tests}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '_')
out=${OUT:-profiling/results/$(date -u +%Y%m%d)-${gpu:-nogpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  echo "# $(date -u +%FT%TZ) step=$step"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1
  git log -1 --format='commit %H' 2>/dev/null || true
} | tee "$out/env-$step.txt"
case "$step" in
  tests)
    python3 -m pytest -q -rs --timeout 300 2>&1 | tee "$out/pytest-all.log" | tail -40
    ;;
  gputests)
    python3 -m pytest -q -rs -m "gpu or multigpu" --timeout 300 2>&1 | tee "$out/pytest-gpu.log" | tail -40
    ;;
  ops)
    # extra args narrow the sweep to fit 10 minutes, e.g.: ops --models llama3-8b --dest device
    python3 profiling/bench_ops.py --out "$out" "${@:2}" 2>&1 | tee "$out/bench_ops.txt" | tail -60
    ;;
  transfer)
    python3 profiling/bench_transfer.py --out "$out" 2>&1 | tee "$out/bench_transfer.txt" | tail -30
    python3 -m kvxfer.demo 2>&1 | tee "$out/demo.txt"
    python3 -m kvxfer.topology 2>&1 | tee "$out/topology.txt"
    ;;
  *)
    echo "unknown step $step (tests | gputests | ops | transfer)"; exit 2 ;;
esac
