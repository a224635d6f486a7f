"""The check after a one-sided read (``ipc`` copies, ``nixl`` direct READs): the exporter's
block epochs now against the lease grant's snapshot.

An exporter bumps a block's epoch when no live export holds it any more (released, aborted,
lease ended, engine closed), and epochs only grow. A loader that read blocks straight out of
the exporter's memory compares their epochs *after* the read with the snapshot its grant
returned: a block released before or during the read shows a moved epoch, and its load is
failed, never delivered (one check after the copy also catches a release between the grant
and the copy)."""

from __future__ import annotations

import numpy as np

from .. import idops

__all__ = ["stale_loads"]


def stale_loads(ep: np.ndarray, loads, granted: dict[str, bytes], s: int) -> dict[str, str]:
    """Loads whose source blocks' epochs in ``ep`` moved since the grant snapshot (``granted``:
    local id -> the grant's epochs, native int64 bytes) -> why (source rank ``s``)."""
    why = f"exporter rank {s}: blocks released before or during the copy (lease ended); not delivered"
    if len(loads) == 1:  # one load: one compare, no lists
        it = loads[0]
        g = granted[it.request_id]
        if len(g) == 8 * it.src_ids.size and idops.unchanged(ep, it.src_ids, g):
            return {}
    out: dict[str, str] = {}
    ids_list, snaps, checked = [], [], []
    for it in loads:
        ids = it.src_ids
        g = granted[it.request_id]
        if len(g) != 8 * ids.size:  # the exporter grants only params naming its export's ids
            out[it.request_id] = f"exporter rank {s}: the grant covers other blocks than the params'"
            continue
        ids_list.append(ids)
        snaps.append(g)
        checked.append(it.request_id)
    for i in idops.moved(ep, ids_list, snaps) if checked else ():
        out[checked[i]] = why
    return out
