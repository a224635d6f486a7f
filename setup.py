"""Build hook: packages are declared in pyproject.toml; the CUDA kernels (csrc/) are added here.

``build_py`` ships the kernel sources as ``kvxfer/csrc/`` (for the NVRTC fallback) and, when
nvcc is found (PATH, or ``$CUDA_HOME/bin``), compiles them into
``kvxfer/_prebuilt/kvxfer_kernels.fatbin``: SASS for sm_80 and sm_90a plus compute_90 PTX that
newer GPUs JIT. Without nvcc the install still succeeds (kernels compile at run time with
NVRTC). ``KVXFER_NO_NVCC=1`` skips nvcc; a failing nvcc fails the build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
FATBIN = "kvxfer_kernels.fatbin"
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
GENCODES = (
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
)


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME / $CUDA_PATH, else None."""
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def nvcc_command(nvcc: str, out: Path | str, src: Path | str = CSRC / "kvx_kernels.cu") -> list[str]:
    """The nvcc command that builds the kernel fatbin (also used by the tests)."""
    return [
        nvcc,
        "-std=c++17",
        "-O3",
        "-fatbin",
        *GENCODES,
        "-Werror",
        "all-warnings",
        "-o",
        str(out),
        str(src),
    ]


def kernel_sources() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in SOURCE_SUFFIXES)


class BuildPyWithKernels(build_py):
    """build_py + kernel sources as package data + the nvcc fatbin when nvcc exists."""

    def run(self) -> None:
        super().run()
        pkg = Path(self.build_lib) / "kvxfer"
        for src in kernel_sources():
            dest = pkg / "csrc" / src.relative_to(CSRC)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
        nvcc = None if os.environ.get("KVXFER_NO_NVCC") else find_nvcc()
        if nvcc is None:
            print("kvxfer: nvcc not found; CUDA kernels will be compiled with NVRTC at run time")
            return
        out = pkg / "_prebuilt" / FATBIN
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = nvcc_command(nvcc, out)
        print("kvxfer: " + " ".join(cmd))
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildPyWithKernels})
