"""Whether NIXL can be imported, and importing it (lazily) for the ``nixl`` transport.

NIXL is optional (``pip install 'kvxfer[nixl]'``). Nothing imports it before an agent is made
(:func:`load_nixl`, called by :class:`kvxfer.transports.nixl.agent.NixlAgent`);
:func:`nixl_status` says whether it can be imported, without importing it, and
:func:`require_nixl` raises :class:`NixlUnavailable` (an ``ImportError``) naming how to install
it. kvxfer lowers NIXL's own Python logger (which prints INFO lines on stdout) to WARNING unless
``$NIXL_LOG_LEVEL`` is set.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Any

__all__ = [
    "INSTALL_HINT",
    "NIXL_MODULES",
    "NixlUnavailable",
    "load_nixl",
    "nixl_bindings",
    "nixl_status",
    "require_nixl",
]

# Where the NIXL Python API lives: the meta package (``nixl``, picks the CUDA 12/13 build at
# import) or one build directly (``nixl-cu12`` / ``nixl-cu13`` wheels).
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
INSTALL_HINT = "pip install 'kvxfer[nixl]' (NIXL 1.5; with a CPU torch: pip install nixl-cu13==1.5.1)"

_api: Any = None


class NixlUnavailable(ImportError):
    """NIXL cannot be imported here (the message names why and how to install it)."""


def nixl_status() -> str:
    """``""`` when a NIXL Python API can be imported, else why not (never imports it)."""
    if _api is not None:
        return ""
    for name in NIXL_MODULES:
        top = name.partition(".")[0]
        try:
            if importlib.util.find_spec(top) is not None:
                return ""
        except (ImportError, ValueError):  # pragma: no cover - a broken install
            continue
    return f"NIXL is not installed (no module {', '.join(m.partition('.')[0] for m in NIXL_MODULES)}): {INSTALL_HINT}"


def require_nixl(what: str = "transport='nixl'") -> None:
    """Raise :class:`NixlUnavailable` naming ``what`` when NIXL cannot be imported."""
    why = nixl_status()
    if why:
        raise NixlUnavailable(f"{what} needs NIXL: {why}")


def load_nixl():
    """Import the NIXL Python API (first of :data:`NIXL_MODULES` that imports); raises
    :class:`NixlUnavailable` with every import error when none does."""
    global _api
    if _api is not None:
        return _api
    errors = []
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # ImportError, or a build for another CUDA that fails to load
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        _api = mod
        return mod
    raise NixlUnavailable("NIXL could not be imported (" + "; ".join(errors) + f"). {INSTALL_HINT}")


def nixl_bindings():
    """NIXL's compiled bindings module (beside the Python API :func:`load_nixl` imported)."""
    return importlib.import_module(load_nixl().__name__.rpartition(".")[0] + "._bindings")
