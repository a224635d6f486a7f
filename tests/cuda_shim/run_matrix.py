"""Run the CUDA-kernel matrix through the host shim; one JSON line per case on stdout.

Usage: python run_matrix.py LIB.so   (under LD_PRELOAD=libasan.so for the sanitized build)
Each line: {"id": case id, "ok": bool, "error": message or null, "entry": launched entry names}.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from cases import matrix, run_case  # noqa: E402
from host_kernels import HostKernels  # noqa: E402


def _fastdiv_check(kernels: HostKernels) -> str | None:
    rng = random.Random(0)
    divisors = [1, 2, 3, 5, 7, 16, 24, 96, 255, 4096, 65537, (1 << 31) - 1] + [
        rng.randrange(1, 1 << 20) for _ in range(50)
    ]
    for d in divisors:
        for n in [0, 1, d - 1, d, d + 1, (1 << 32) - 1, (1 << 31)] + [
            rng.randrange(1 << 32) for _ in range(200)
        ]:
            n %= 1 << 32
            if kernels.fastdiv(d, n) != n // d:
                return f"FastDiv({d}).div({n}) = {kernels.fastdiv(d, n)}, want {n // d}"
    return None


def main() -> int:
    lib = sys.argv[1]
    print(
        json.dumps(
            {
                "id": "fastdiv",
                "ok": _fastdiv_check(HostKernels(lib)) is None,
                "error": _fastdiv_check(HostKernels(lib)),
                "entry": [],
            }
        ),
        flush=True,
    )
    for case in matrix():
        kernels = HostKernels(lib, case.max_blocks)
        try:
            run_case(case, "cpu", kernels)
            err = None
        except Exception as e:  # reported per case; the pytest side fails that case
            err = f"{type(e).__name__}: {e}"
        entries = [f"{x.name} grid={x.grid}" for x in kernels.launches]
        print(json.dumps({"id": case.id, "ok": err is None, "error": err, "entry": entries}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
