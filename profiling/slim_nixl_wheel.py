"""Repack a ``nixl-cu13`` wheel with only what kvxfer's ``nixl`` transport loads, so that it fits
what the GPU machine carries (64 MiB with the working tree; the wheel is ~59 MB).

Kept: the Python package (``nixl_cu13``), NIXL's core libraries, its UCX plugin, UCX with every
transport module it loads at run time (the perftest modules excepted), and every library those
need (the ``DT_NEEDED`` closure, read with ``readelf``). Left out: the expert-parallel extension
(``nixl_ep_cu13``: three builds of ~31 MB, one per torch version), the other plugins (GDS, POSIX,
object stores, GPUNetIO, libfabric, ...) with the libraries only they need, the telemetry
exporters, the headers and the example programs. ``RECORD`` is rewritten for what is left.
A plugin that is left out is one NIXL cannot create; kvxfer creates UCX only
(``kvxfer.transports.nixl.agent``).

    python profiling/slim_nixl_wheel.py .whl/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl

writes ``<name>`` in place of the wheel (the original kept as ``<name>.full``, or in ``--keep-full
DIR``: outside ``.whl/``, which the device call carries) and prints the sizes (``-v``: and what it
left out).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

# Where the UCX plugin lives in the wheel (NIXL looks in both), and UCX's run-time modules.
_SEEDS = (
    re.compile(r"^nixl_cu13/[^/]+\.so$"),
    re.compile(r"^\.nixl_cu13\.mesonpy\.libs/[^/]+\.so[.0-9]*$"),
    re.compile(r"^(\.nixl_cu13\.mesonpy\.libs/plugins|nixl_cu13\.libs/nixl)/libplugin_UCX\.so$"),
    re.compile(r"^nixl_cu13\.libs/ucx/(?!libucx_perftest)[^/]+\.so[.0-9]*$"),
)
_DROP_DIRS = ("nixl_ep_cu13/", "nixl_cu13.scripts/")
_DROP_DATA = re.compile(r"^nixl_cu13-[^/]+\.data/(headers|scripts)/")


def _needed(data: bytes) -> list[str]:
    """``DT_NEEDED`` entries of one ELF file."""
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        out = subprocess.run(["readelf", "-d", f.name], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def _is_elf(name: str) -> bool:
    return bool(re.search(r"\.so(\.[0-9.]+)?$", name))


def kept_names(zf: zipfile.ZipFile) -> set[str]:
    """The wheel's members to keep (see the module doc)."""
    names = zf.namelist()
    by_base: dict[str, list[str]] = {}
    for n in names:
        if _is_elf(n):
            by_base.setdefault(os.path.basename(n), []).append(n)
    todo = [n for n in names if any(p.match(n) for p in _SEEDS)]
    elf: set[str] = set()
    while todo:
        n = todo.pop()
        if n in elf:
            continue
        elf.add(n)
        for dep in _needed(zf.read(n)):
            todo.extend(by_base.get(dep, []))  # absent: the system's (libc, libcuda, libcudart)
    keep = set()
    for n in names:
        if n.startswith(_DROP_DIRS) or _DROP_DATA.match(n):
            continue
        if _is_elf(n) and n not in elf:
            continue
        keep.add(n)
    return keep


def slim(src: str, dst: str) -> tuple[int, int, list[str]]:
    """Write the slim wheel ``dst`` from ``src``: (bytes before, bytes after, members left out)."""
    with zipfile.ZipFile(src) as zf:
        keep = kept_names(zf)
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        dropped = sorted(n for n in zf.namelist() if n not in keep)
        rows = []
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as out:
            for info in zf.infolist():
                if info.filename not in keep or info.filename == record:
                    continue
                data = zf.read(info)
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append((info.filename, f"sha256={digest}", str(len(data))))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows([*rows, (record, "", "")])
            out.writestr(zf.getinfo(record), buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    return os.path.getsize(src), os.path.getsize(dst), dropped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", help="a nixl_cu13 wheel")
    ap.add_argument("--keep-full", default=None, help="a directory to move the original wheel to")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the members left out")
    a = ap.parse_args(argv)
    if not os.path.basename(a.wheel).startswith("nixl_cu13-"):
        ap.error(f"{a.wheel}: not a nixl_cu13 wheel")
    full = os.path.join(a.keep_full, os.path.basename(a.wheel)) if a.keep_full else a.wheel + ".full"
    shutil.move(a.wheel, full)
    before, after, dropped = slim(full, a.wheel)
    print(
        f"{os.path.basename(a.wheel)}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB, {len(dropped)} members left out"
    )
    for n in dropped if a.verbose else ():
        print(f"  - {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
