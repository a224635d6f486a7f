"""The kvxfer CUDA entry points compiled by g++ through the host shim, driven with ctypes.

``HostKernels(lib_path, max_blocks)`` has the backend functions ``gather``/``scatter``/``copy``
of :mod:`kvxfer.backends.cuda`: it builds the very same launch (entry, grid, arguments, block
and layer tables) with ``plan_*`` and runs the entry serially over the grid on CPU tensors.
``build(out_dir)`` compiles ``csrc/host/kvx_host.cpp`` with ASan + UBSan.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
from pathlib import Path

from kvxfer.backends import cuda

SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer")


def build(out_dir: Path, sanitize: bool = True) -> Path:
    """Compile the host shim library into ``out_dir`` (reused while the sources are unchanged)."""
    src_dir = cuda.source_dir()
    sources = sorted(p for p in src_dir.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + str(sanitize).encode()).hexdigest()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    lib = Path(out_dir) / f"kvx_host_{digest[:16]}.so"
    if not lib.exists():
        cmd = [
            "g++",
            "-std=c++17",
            "-O1",
            "-g",
            "-fPIC",
            "-shared",
            "-Wall",
            "-Wextra",
            "-Werror",
            *(SANITIZE if sanitize else ()),
            "-o",
            str(lib),
            str(src_dir / "host" / "kvx_host.cpp"),
        ]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return lib


class HostKernels:
    """Backend-shaped wrapper running the g++-built entry points on CPU tensors."""

    def __init__(self, lib_path: Path | str, max_blocks: int = 3) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.kvx_host_launch.argtypes = [
            ctypes.c_char_p,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.c_int,
        ]
        self.lib.kvx_host_launch.restype = ctypes.c_int
        self.lib.kvx_host_fastdiv.argtypes = [ctypes.c_uint, ctypes.c_uint]
        self.lib.kvx_host_fastdiv.restype = ctypes.c_uint
        self.max_blocks = max_blocks
        self.launches: list[cuda.Launch] = []

    def fastdiv(self, d: int, n: int) -> int:
        return self.lib.kvx_host_fastdiv(d, n)

    def _run(self, launch: cuda.Launch) -> None:
        self.launches.append(launch)
        args = (ctypes.c_longlong * len(launch.args))(*launch.args)
        rc = self.lib.kvx_host_launch(launch.name.encode(), launch.grid, launch.block, args, len(launch.args))
        if rc != 0:
            raise RuntimeError(
                f"host shim rejected launch {launch.name} grid={launch.grid} block={launch.block}"
            )

    def gather(self, src, wire) -> None:
        self._run(cuda.plan_gather(src, wire.data_ptr(), self.max_blocks))

    def scatter(self, wire, dst) -> None:
        self._run(cuda.plan_scatter(wire.data_ptr(), dst, self.max_blocks))

    def copy(self, src, dst) -> None:
        self._run(cuda.plan_copy(src, dst, self.max_blocks))
