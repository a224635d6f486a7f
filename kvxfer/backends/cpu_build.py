"""Building kvxfer's host-side native code with a host C++ compiler: the CPU backend
(``csrc/cpu/kvx_cpu.cpp``, a shared library loaded with ctypes) and the control-path helpers
(``csrc/ctl/kvx_ctl.cpp``, a CPython extension module; :mod:`kvxfer.idops`).

Standard library only: ``setup.py`` loads this file by path at install time (before kvxfer or
torch are importable), and :mod:`kvxfer.backends.cpu` / :mod:`kvxfer.idops` use it to find, or
build lazily, their library at run time. A library's file name carries a hash of its source and
compile command, so a library built from other sources is never loaded by mistake.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "ABI_VERSION",
    "CONTROL_MODULE",
    "CPU_LIBRARY",
    "CXX_FLAGS",
    "SOURCE",
    "BuildError",
    "Target",
    "build",
    "cache_dir",
    "compile_command",
    "find_compiler",
    "library_name",
    "prebuilt_dir",
    "source_dir",
    "source_hash",
]

SOURCE = Path("cpu") / "kvx_cpu.cpp"  # relative to the csrc directory
ABI_VERSION = 2  # must equal kAbiVersion in the source
CXX_FLAGS = ("-std=c++17", "-O3", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra", "-Werror")
BUILD_TIMEOUT_S = 300


class Target(NamedTuple):  # not a dataclass: setup.py runs this file without a module entry
    """One native library: its source (relative to ``csrc``), compile flags and file name
    (``<prefix><hash><suffix>``). ``headers``: the local headers the source includes (relative
    to ``csrc``; the source is the one file compiled), hashed with it."""

    source: Path
    flags: tuple[str, ...]
    prefix: str
    suffix: str
    headers: tuple[Path, ...] = ()


CPU_LIBRARY = Target(SOURCE, CXX_FLAGS, "libkvx_cpu-", ".so")
# An extension module of this interpreter: its headers, its ABI's file suffix (both in the hash).
CONTROL_MODULE = Target(
    Path("ctl") / "kvx_ctl.cpp",
    ("-std=c++17", "-O3", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror",
     "-Wno-missing-field-initializers", f"-I{sysconfig.get_paths()['include']}"),
    "_kvx_ctl-",
    sysconfig.get_config_var("EXT_SUFFIX") or ".so",
    tuple(Path("ctl") / h for h in ("ctl_common.h", "block_ids.h", "lease_slots.h", "onesided_reads.h", "load_book.h", "load_lane.h", "load_book_type.h", "exporter_slots.h", "export_book.h", "export_book_export.h", "export_book_msgs.h", "export_book_type.h", "token_hash.h", "blake2b.h", "params_fields.h")),
)  # fmt: skip


def prebuilt_dir() -> Path:
    """``kvxfer/_prebuilt``: where ``setup.py`` puts the libraries it built."""
    return Path(__file__).resolve().parent.parent / "_prebuilt"


def cache_dir() -> Path:
    """Where libraries are built on first use: ``$KVXFER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kvxfer``, else ``~/.cache/kvxfer``."""
    if os.environ.get("KVXFER_CACHE_DIR"):
        return Path(os.environ["KVXFER_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvxfer"


def source_dir(target: Target = CPU_LIBRARY) -> Path:
    """The ``csrc`` directory holding ``target``'s source: shipped in the package
    (``kvxfer/csrc``) or the source checkout's."""
    here = Path(__file__).resolve().parent.parent  # kvxfer/
    for cand in (here / "csrc", here.parent / "csrc"):
        if (cand / target.source).is_file():
            return cand
    raise FileNotFoundError(f"kvxfer native source ({target.source}) not found")


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


def source_hash(csrc: Path | str, target: Target = CPU_LIBRARY) -> str:
    """16 hex digits identifying the source, its headers and the compile flags."""
    h = hashlib.sha256((Path(csrc) / target.source).read_bytes())
    for header in target.headers:
        h.update((Path(csrc) / header).read_bytes())
    h.update(" ".join(target.flags).encode())
    h.update(str(ABI_VERSION).encode())
    return h.hexdigest()[:16]


def library_name(csrc: Path | str, target: Target = CPU_LIBRARY) -> str:
    """File name of the library built from the sources under ``csrc``."""
    return f"{target.prefix}{source_hash(csrc, target)}{target.suffix}"


def compile_command(cxx: str, out: Path | str, csrc: Path | str, target: Target = CPU_LIBRARY) -> list[str]:
    """The command that builds the library ``out`` from ``target``'s source under ``csrc``."""
    return [*shlex.split(cxx), *target.flags, "-o", str(out), str(Path(csrc) / target.source)]


def build(
    out_dir: Path | str, csrc: Path | str, cxx: str | None = None, target: Target = CPU_LIBRARY
) -> Path:
    """Compile the library into ``out_dir`` (kept if already there); its path.

    The library is written under a temporary name and renamed into place, so concurrent
    builds (several processes starting at once) never load a half-written file.
    Raises :class:`BuildError` when no compiler is found or it fails.
    """
    out_dir = Path(out_dir)
    path = out_dir / library_name(csrc, target)
    if path.is_file():
        return path
    cxx = cxx or find_compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.prefix}", suffix=target.suffix, dir=out_dir)
    os.close(fd)
    cmd = compile_command(cxx, tmp, csrc, target)
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
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
