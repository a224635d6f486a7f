"""The public surface, listed: what users import from ``kvxfer`` and ``kvxfer.ops``. A name that
is added, removed or moved changes this list, so such a change is a decision made in review; a
moved name keeps an alias that warns for one release."""

from __future__ import annotations

import importlib
import subprocess
import sys

import kvxfer
from kvxfer import ops

KVXFER = [
    "AttentionGroup",
    "CompletionAggregator",
    "KVCacheSpec",
    "KVTransferParams",
    "Layout",
    "Read",
    "StateGroup",
    "StateSpec",
    "TransferEngine",
    "TransferPlan",
    "__version__",
    "alloc_shm_caches",
    "plan_reads",
]

OPS = [
    "BACKENDS",
    "HOST_WIRE_MAX_SMS",
    "CheckedIds",
    "PagedCache",
    "PreparedCopy",
    "backend_status",
    "copy_blocks",
    "gather_blocks",
    "host_wire_budget",
    "last_backend",
    "make_side",
    "path_stats",
    "register_caches",
    "reset_backends",
    "resolve_backend",
    "scatter_blocks",
    "warmup",
]

# moved public names: old module -> (name, where it lives now)
ALIASES = {"kvxfer.transports.shm": ("alloc_shm_caches", "kvxfer.transports.ipc.shm")}


def test_the_public_names_are_these():
    assert sorted(kvxfer.__all__) == sorted(KVXFER)
    assert sorted(ops.__all__) == sorted(OPS)


def test_every_public_name_resolves():
    for name in KVXFER:
        assert getattr(kvxfer, name) is not None, name
    for name in OPS:
        assert getattr(ops, name) is not None, name
    from kvxfer.transports.ipc.shm import alloc_shm_caches

    assert kvxfer.alloc_shm_caches is alloc_shm_caches


def test_a_moved_name_still_imports_and_warns():
    """Each alias, imported in a fresh interpreter (a module warns once, at its first import):
    the same object as at its new place, with a DeprecationWarning that names the new place."""
    for old, (name, new) in ALIASES.items():
        code = (
            "import warnings\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            f"    from {old} import {name} as a\n"
            f"from {new} import {name} as b\n"
            "assert a is b\n"
            "msgs = [str(x.message) for x in w if issubclass(x.category, DeprecationWarning)]\n"
            f"assert any({new!r} in m for m in msgs), msgs\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (old, r.stderr)
        assert importlib.import_module(new)
