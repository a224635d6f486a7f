"""Building the native CPU backend (``csrc/cpu/kvx_cpu.cpp``) with a host C++ compiler.

Standard library only: ``setup.py`` loads this file by path at install time (before kvxfer or
torch are importable), and :mod:`kvxfer.backends.cpu` uses it to find, or build lazily, the
library at run time. The library's file name carries a hash of its source and compile command,
so a library built from other sources is never loaded by mistake.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "ABI_VERSION",
    "CXX_FLAGS",
    "SOURCE",
    "BuildError",
    "build",
    "compile_command",
    "find_compiler",
    "library_name",
    "source_hash",
]

SOURCE = Path("cpu") / "kvx_cpu.cpp"  # relative to the csrc directory
ABI_VERSION = 1  # must equal kAbiVersion in the source
CXX_FLAGS = ("-std=c++17", "-O3", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra", "-Werror")
BUILD_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """The compiler is missing or failed; the message says which and why."""


def find_compiler() -> str | None:
    """``$CXX`` if set (even when it does not exist: that is reported at build time), else
    ``g++`` or ``c++`` on PATH, else None."""
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    for name in ("g++", "c++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def source_hash(csrc: Path | str) -> str:
    """16 hex digits identifying the source and the compile flags."""
    h = hashlib.sha256((Path(csrc) / SOURCE).read_bytes())
    h.update(" ".join(CXX_FLAGS).encode())
    h.update(str(ABI_VERSION).encode())
    return h.hexdigest()[:16]


def library_name(csrc: Path | str) -> str:
    """File name of the library built from the sources under ``csrc``."""
    return f"libkvx_cpu-{source_hash(csrc)}.so"


def compile_command(cxx: str, out: Path | str, csrc: Path | str) -> list[str]:
    """The command that builds the library ``out`` from ``csrc/cpu/kvx_cpu.cpp``."""
    return [*shlex.split(cxx), *CXX_FLAGS, "-o", str(out), str(Path(csrc) / SOURCE)]


def build(out_dir: Path | str, csrc: Path | str, cxx: str | None = None) -> Path:
    """Compile the library into ``out_dir`` (kept if already there); its path.

    The library is written under a temporary name and renamed into place, so concurrent
    builds (several processes starting at once) never load a half-written file.
    Raises :class:`BuildError` when no compiler is found or it fails.
    """
    out_dir = Path(out_dir)
    target = out_dir / library_name(csrc)
    if target.is_file():
        return target
    cxx = cxx or find_compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libkvx_cpu-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = compile_command(cxx, tmp, csrc)
    try:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"{shlex.join(cmd)}: {type(e).__name__}: {e}") from None
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip()[-2000:]
            raise BuildError(
                f"{shlex.join(cmd)} exited with {res.returncode}" + (f":\n{tail}" if tail else "")
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
