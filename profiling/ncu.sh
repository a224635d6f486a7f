#!/usr/bin/env bash
# Run a kvxfer benchmark under Nsight Compute, profiling only kvxfer's copy kernels inside the
# benchmark's timed loops (not the verification pass, the warmup or the limit copies).
#
#   profiling/ncu.sh [-s full|focused] [-k REGEX] [-c COUNT] [-n NVTX_RANGE] [-o NAME] [--] COMMAND...
#
#   -s SET    full (default): every section; focused: speed of light, memory workload (chart and
#             tables: sectors per request, L2/DRAM throughput), launch stats, occupancy, warp stalls
#   -k REGEX  kernel-name filter (default 'kvx|move_rows|gather|scatter': the Triton kernel
#             move_rows_kernel, the CUDA kernels kvx_{gather,scatter,copy}_w<bytes>); '.' for all
#   -c COUNT  profile at most COUNT kernel launches (default 10; each is replayed many times)
#   -n RANGE  only kernels inside this NVTX push/pop range, ncu syntax: e.g. 'op:gather:triton:llama3-8b:NHD:device:4096tok/'
#   -o NAME   report name (default kvxfer_<date>_<time>): $KVXFER_PROFILE_OUT/NAME.ncu-rep
#             (default directory: profiling/out, gitignored)
#   NCU_FLAGS="..."  extra ncu flags
#
# The command runs with KVXFER_PROFILE_RANGE=ops: the benchmarks bracket each timed loop with
# cudaProfilerStart/Stop and ncu starts with --profile-from-start off. Keep the run small:
#   profiling/ncu.sh -s focused -- python profiling/bench_ops.py --backends triton \
#       --models llama3-8b --layouts NHD --dest device --ops gather --sizes 4096 --iters 2 --warmup 1
# Needs access to GPU performance counters (root, or NVreg_RestrictProfilingToAdminUsers=0).
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out_dir="${KVXFER_PROFILE_OUT:-$here/out}"
name="kvxfer_$(date +%Y%m%d_%H%M%S)"
set_name=full
kernel_regex='kvx|move_rows|gather|scatter'
count=10
nvtx_range=""
while getopts ":s:k:c:n:o:h" opt; do
  case "$opt" in
    s) set_name="$OPTARG" ;;
    k) kernel_regex="$OPTARG" ;;
    c) count="$OPTARG" ;;
    n) nvtx_range="$OPTARG" ;;
    o) name="$OPTARG" ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ "${1:-}" == "--" ]]; then shift; fi
if (($# == 0)); then usage >&2; exit 2; fi
if [[ ! "$count" =~ ^[0-9]+$ ]]; then echo "ncu.sh: -c needs a number, got '$count'" >&2; exit 2; fi
case "$set_name" in
  full) sections=(--set full) ;;
  focused)
    sections=(
      --section SpeedOfLight
      --section MemoryWorkloadAnalysis
      --section MemoryWorkloadAnalysis_Chart
      --section MemoryWorkloadAnalysis_Tables
      --section LaunchStats
      --section Occupancy
      --section WarpStateStats
    )
    ;;
  *) echo "ncu.sh: -s must be full or focused, got '$set_name'" >&2; exit 2 ;;
esac
if ! command -v ncu >/dev/null 2>&1; then
  echo "ncu.sh: ncu not found on PATH (Nsight Compute ships with the CUDA toolkit)" >&2
  exit 127
fi
mkdir -p "$out_dir"

flags=(
  --target-processes all
  --profile-from-start off          # only inside cudaProfilerStart/Stop (KVXFER_PROFILE_RANGE=ops)
  --kernel-name-base function
  --kernel-name "regex:$kernel_regex"
  --launch-count "$count"
  --nvtx                            # NVTX context in the report, and --nvtx-include below
  "${sections[@]}"
  --force-overwrite
  --export "$out_dir/$name"
)
if [[ -n "$nvtx_range" ]]; then flags+=(--nvtx-include "$nvtx_range"); fi
extra=()
if [[ -n "${NCU_FLAGS:-}" ]]; then read -r -a extra <<<"$NCU_FLAGS"; fi

export KVXFER_PROFILE_RANGE=ops
echo "+ ncu ${flags[*]} ${extra[*]} $*" >&2
ncu "${flags[@]}" "${extra[@]}" "$@"
echo "ncu.sh: report $out_dir/$name.ncu-rep (ncu --import it, or open in the Nsight Compute GUI)" >&2
