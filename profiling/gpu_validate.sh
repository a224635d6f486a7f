#!/usr/bin/env bash
# Validate kvxfer on a lent GPU machine: every test (GPU-marked ones included), then the
# benchmark sweeps; raw logs, JSON and PNGs go to $OUT (or profiling/results/<date>-<gpu>/).
#
# Here:    bash profiling/gpu_wheels.sh            # once: fetch wheels the GPU image lacks
# Device:  run(command="bash profiling/gpu_validate.sh build && bash profiling/gpu_validate.sh tests", carry=[".whl"])
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
build_fatbin() {
  # the fatbin setup.py would build, into the source tree (kvxfer/_prebuilt/, git-ignored), then
  # load it through the CUDA backend and say where the kernels came from (fatbin, not NVRTC)
  nvcc --version | tail -2
  python3 -c "from setup import find_nvcc, nvcc_command; import pathlib, subprocess, sys
out = pathlib.Path('kvxfer/_prebuilt/kvxfer_kernels.fatbin'); out.parent.mkdir(exist_ok=True)
cmd = nvcc_command(find_nvcc(), out); print(' '.join(cmd)); subprocess.run(cmd, check=True)"
  cuobjdump --list-elf kvxfer/_prebuilt/kvxfer_kernels.fatbin 2>&1 | head
  python3 -c "import torch; from kvxfer.backends import cuda; assert cuda.is_available(torch.device('cuda')); print('kernels loaded from', cuda.loaded_from(0))"
  # every GPU backend must be there: a run without one measures the other alone (2026-11-28: the
  # Triton backend failed to import on the device and every step fell back to CUDA C++)
  python3 -c "import torch; from kvxfer.backends import registry
for name, row in registry.backend_status(torch.device('cuda')).items():
    print('backend', name, 'ok' if row['available'] else 'UNAVAILABLE: ' + row['reason'])"
  # the control-path helpers (kvxfer/idops.py), built with the host compiler as an engine's start() would
  python3 -c "from kvxfer import idops; print('control helpers', idops.ensure(), idops.status())"
}
case "$step" in
  build)
    build_fatbin 2>&1 | tee "$out/build.txt"
    ;;
  tests)
    # PYTEST_ARGS: extra pytest arguments (e.g. --deselect NODE)
    # shellcheck disable=SC2086
    python3 -m pytest -q -rfEs --timeout 120 --durations=15 ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest-all.log" | tail -40
    ;;
  gputests)
    # shellcheck disable=SC2086
    # -v: a line per test as it ends, so a cut run names the test it was in; each failure's report
    # lands in failures-gpu*.txt at once (tests/conftest.py), not only in the summary at the end
    KVXFER_FAILURES_NOW="$out/failures-gpu${TAG:+-$TAG}.txt" python3 -m pytest -v -rfEs -m "gpu or multigpu" \
      --timeout 120 --durations=15 -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest-gpu${TAG:+-$TAG}.log" | tail -40
    ;;
  ops)
    # extra args narrow the sweep to fit 10 minutes, e.g.: ops --models llama3-8b --dest device
    python3 profiling/bench_ops.py --out "$out" "${@:2}" 2>&1 | tee "$out/bench_ops.txt" | tail -60
    ;;
  ncu)
    # one Nsight Compute look at the worst kernel row of the last ops sweep ($out/bench_ops.json):
    # the lowest %limit among the triton/cuda rows at 4096 tokens; extra args go to ncu.sh
    read -r model layout dest op backend < <(python3 -c "
import json, sys
rows = [r for r in json.load(open('$out/bench_ops.json'))['rows']
        if r['backend'] in ('triton', 'cuda') and r['tokens'] == 4096 and not r.get('error')]
w = min(rows, key=lambda r: r['pct_limit'])
print(w['model'], w['layout'], w['dest'], w['op'], w['backend'])")
    echo "worst row: $model $layout $dest $op $backend" | tee "$out/ncu_worst.txt"
    KVXFER_PROFILE_OUT="$out" bash profiling/ncu.sh -s focused -c 2 -o ncu_worst "${@:2}" -- \
      python3 profiling/bench_ops.py --backends "$backend" --models "$model" --layouts "$layout" \
      --dest "$dest" --ops "$op" --sizes 4096 --iters 2 --warmup 1 2>&1 | tail -5
    ncu --import "$out/ncu_worst.ncu-rep" --page details 2>&1 | tee -a "$out/ncu_worst.txt" | tail -80
    ;;
  sanitize)
    # compute-sanitizer memcheck on one test node id (slow under the tool: one node at a time)
    compute-sanitizer --tool memcheck --target-processes all python3 -m pytest -x -q -p no:cacheprovider \
      "${2:?usage: gpu_validate.sh sanitize TEST_NODE_ID}" 2>&1 | tee "$out/sanitize.txt" | tail -60
    ;;
  transfer)
    python3 profiling/bench_transfer.py --out "$out" "${@:2}" 2>&1 | tee "$out/bench_transfer.txt" | tail -30
    python3 -m kvxfer.demo 2>&1 | tee "$out/demo.txt"
    python3 -m kvxfer.topology 2>&1 | tee "$out/topology.txt"
    ;;
  latency)  # one request's timeline through the engine (ipc one-sided and messaged, then pg), P and D in two processes
    python3 profiling/bench_latency.py --out "$out" "${@:2}" 2>&1 | tee "$out/bench_latency.txt" | tail -30
    python3 profiling/bench_latency.py --transport pg --tokens 4096 --reqs 10 --out "$out/pg" 2>&1 | tee "$out/bench_latency_pg.txt" | tail -14
    ;;
  batching)  # a batch of requests ending inside a block: all tokens as slots vs blocks + tails
    python3 profiling/bench_batching.py --out "$out" "${@:2}" 2>&1 | tee "$out/bench_batching.txt" | tail -20
    ;;
  hostcost)  # the engine's per-request host cost on this machine's CPU (DESIGN's target is set for it)
    python3 profiling/bench_engine.py --host-only --host-iters "${2:-200}" 2>&1 | tee "$out/bench_engine.txt" | tail -24
    ;;
  *)
    echo "unknown step $step (build | tests | gputests | ops | ncu | sanitize | transfer | latency | batching | hostcost)"; exit 2 ;;
esac
