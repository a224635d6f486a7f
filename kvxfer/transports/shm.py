"""Deprecated: :mod:`kvxfer.transports.ipc.shm` (moved with the ipc transport into its folder).

Kept for one release so code written against the earlier layout still imports; it warns once
on import. Import ``alloc_shm_caches`` from :mod:`kvxfer` (or :mod:`kvxfer.transports.ipc.shm`).
"""

from __future__ import annotations

import warnings

from .ipc.shm import *  # noqa: F403 (the moved module's public names)
from .ipc.shm import __all__  # noqa: F401

warnings.warn(
    "kvxfer.transports.shm moved to kvxfer.transports.ipc.shm; import alloc_shm_caches from kvxfer "
    "(this alias goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)
