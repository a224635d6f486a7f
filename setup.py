"""Build hook: packages are declared in pyproject.toml; the native code (csrc/) is added here.

``build_py`` ships the kernel sources as ``kvxfer/csrc/`` (for the NVRTC fallback and the CPU
backend's lazy build), then:

- CPU backend and control helpers: when a C++ compiler is found (``$CXX``, else ``g++`` /
  ``c++`` on PATH), compiles ``csrc/cpu/kvx_cpu.cpp`` into ``kvxfer/_prebuilt/libkvx_cpu-<hash>.so``
  and the extension module ``csrc/ctl/kvx_ctl.cpp`` into ``kvxfer/_prebuilt/_kvx_ctl-<hash><ext>``.
  In an editable install (``pip install -e .``) they go into the source tree's ``kvxfer/_prebuilt/``,
  where the package is imported from. No compiler, or a failing one, never fails the install: a
  ``kvxfer: WARNING`` line says why, and each is compiled on first use instead (else CPU ops fall
  back to the torch reference, kvxfer/backends/cpu.py, and the bookkeeping to numpy,
  kvxfer/idops.py). ``KVXFER_NO_CXX=1`` skips both.
- CUDA kernels: when nvcc is found (PATH, or ``$CUDA_HOME/bin``), compiles them into
  ``kvxfer/_prebuilt/kvxfer_kernels.fatbin``: SASS for sm_80 and sm_90a plus compute_90 PTX that
  newer GPUs JIT. Without nvcc the install still succeeds (kernels compile at run time with
  NVRTC). ``KVXFER_NO_NVCC=1`` skips nvcc; a failing nvcc fails the build.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

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


def cpu_build() -> ModuleType:
    """kvxfer/backends/cpu_build.py, loaded by path (standard library only; kvxfer itself and
    torch are not importable in an isolated build environment)."""
    spec = importlib.util.spec_from_file_location(
        "kvxfer_cpu_build", ROOT / "kvxfer" / "backends" / "cpu_build.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FALLBACKS = {  # what runs when a native library is missing at run time too
    "CPU_LIBRARY": "CPU ops use the slower torch reference backend",
    "CONTROL_MODULE": "the engine's bookkeeping uses numpy (more host time per request)",
}


def build_native(out_dir: Path, which: str) -> Path | None:
    """Build the native library ``which`` (``CPU_LIBRARY``: the CPU backend; ``CONTROL_MODULE``:
    the control-path helpers, kvxfer/idops.py) into ``out_dir``; None (with a warning printed)
    on failure."""
    if os.environ.get("KVXFER_NO_CXX"):
        print(f"kvxfer: KVXFER_NO_CXX set; {which} not built (it compiles on first use if it can)")
        return None
    cb = cpu_build()
    target = getattr(cb, which)
    try:
        cxx = cb.find_compiler()
        if cxx is None:
            raise cb.BuildError("no C++ compiler found (set CXX, or install g++)")
        out = out_dir / cb.library_name(CSRC, target)
        print("kvxfer: " + " ".join(cb.compile_command(cxx, out, CSRC, target)))
        lib = cb.build(out_dir, CSRC, cxx, target)
    except cb.BuildError as e:
        print(
            f"kvxfer: WARNING: {which} not built ({e}); it is compiled on first use if a "
            f"compiler is available then, else {FALLBACKS[which]}"
        )
        return None
    for old in out_dir.glob(f"{target.prefix}*"):  # libraries of earlier sources (editable installs)
        if old != lib:
            old.unlink()
    return lib


class BuildPyWithKernels(build_py):
    """build_py + kernel sources as package data + the CPU backend library when a C++ compiler
    exists + the nvcc fatbin when nvcc exists."""

    def run(self) -> None:
        super().run()
        pkg = Path(self.build_lib) / "kvxfer"
        for src in kernel_sources():
            dest = pkg / "csrc" / src.relative_to(CSRC)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
        # An editable install imports kvxfer from the source tree, not from build_lib.
        prebuilt = (ROOT / "kvxfer" if self.editable_mode else pkg) / "_prebuilt"
        build_native(prebuilt, "CPU_LIBRARY")
        build_native(prebuilt, "CONTROL_MODULE")
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
