#!/usr/bin/env bash
# Run a kvxfer benchmark (or any command) under Nsight Systems, so the timeline shows kvxfer's
# NVTX ranges (benchmark rows, engine requests and phases) and kernel names.
#
#   profiling/nsys.sh [-r] [-o NAME] [--] COMMAND...
#
#   -r        capture only the benchmark sweep: the command is run with KVXFER_PROFILE_RANGE=sweep,
#             which brackets the sweep with cudaProfilerStart/Stop, and nsys records from the start
#             to the stop (leaves out imports, cache allocation and fills)
#   -o NAME   report name (default kvxfer_<date>_<time>); written as
#             $KVXFER_PROFILE_OUT/NAME.nsys-rep (default directory: profiling/out, gitignored)
#   NSYS_FLAGS="..."  extra nsys flags, e.g. NSYS_FLAGS="--gpu-metrics-devices=all"
#
# Example:
#   profiling/nsys.sh -r -o gather_4k -- python profiling/bench_ops.py --backends triton,cuda \
#       --models llama3-8b --sizes 4096 --ops gather
# Open the .nsys-rep in the Nsight Systems GUI; `nsys stats` tables are printed at the end.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out_dir="${KVXFER_PROFILE_OUT:-$here/out}"
name="kvxfer_$(date +%Y%m%d_%H%M%S)"
range=0
while getopts ":ro:h" opt; do
  case "$opt" in
    r) range=1 ;;
    o) name="$OPTARG" ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ "${1:-}" == "--" ]]; then shift; fi
if (($# == 0)); then usage >&2; exit 2; fi
if ! command -v nsys >/dev/null 2>&1; then
  echo "nsys.sh: nsys not found on PATH (Nsight Systems ships with the CUDA toolkit)" >&2
  exit 127
fi
mkdir -p "$out_dir"

flags=(
  profile
  "--trace=cuda,nvtx,osrt"  # CUDA API + kernels + memcpys, NVTX ranges, OS runtime (waits, locks)
  --sample=none             # no CPU IP sampling: smaller report, less perturbation
  --cpuctxsw=none
  --stats=true              # print kernel / memcpy / NVTX summary tables after the run
  --force-overwrite=true
  --output="$out_dir/$name"
)
if ((range)); then
  export KVXFER_PROFILE_RANGE=sweep
  flags+=(--capture-range=cudaProfilerApi --capture-range-end=stop)
fi
extra=()
if [[ -n "${NSYS_FLAGS:-}" ]]; then read -r -a extra <<<"$NSYS_FLAGS"; fi

echo "+ nsys ${flags[*]} ${extra[*]} $*" >&2
nsys "${flags[@]}" "${extra[@]}" "$@"
echo "nsys.sh: report $out_dir/$name.nsys-rep" >&2
