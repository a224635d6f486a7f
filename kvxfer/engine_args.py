"""Checks of :class:`~kvxfer.engine.TransferEngine`'s arguments that are not on a request's
path: the constructor's, ``computed_tokens`` (engines with KV cache groups) and
:meth:`~kvxfer.engine.TransferEngine.mark_ready`'s layers. Each raises ``ValueError`` naming
the argument (``NixlUnavailable``, an ``ImportError``, for ``transport="nixl"`` without NIXL).

The per-request checks of ``export()`` and ``load()`` stay inline in the engine: a call each
would add to every request's host cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import ops
from .backends.base import PagedSide
from .engine_types import check_block_ids
from .grouped import export_ids
from .groups.attention import AttentionGroup, GroupSet
from .groups.state_group import StateGroup
from .limits import MAX_LEASE_S
from .spec import KVCacheSpec
from .transports import TRANSPORTS
from .transports.nixl.availability import require_nixl
from .transports.pg.pipeline import StagedPipeline

__all__ = ["check_engine_args", "layer_mask", "windows_end"]


def check_engine_args(
    spec: KVCacheSpec,
    caches: Sequence[torch.Tensor],
    tp_rank: int,
    tp_size: int,
    engine_id: str,
    transport: str,
    lease_s: float,
    port: int,
    pipeline: StagedPipeline | None,
    auth_key: str | None,
    onesided: bool,
    groups: Sequence[AttentionGroup | StateGroup] | None,
    null_block: int | None,
) -> tuple[PagedSide, GroupSet | None]:
    """Check the constructor's arguments, in the order they are listed (the first bad one is
    named); returns the caches as one side (:func:`kvxfer.ops.make_side`: their block count
    and device) and the groups checked (None without ``groups``)."""
    if not isinstance(spec, KVCacheSpec):
        raise ValueError(f"spec: expected a KVCacheSpec, got {type(spec).__name__}")
    spec.heads_of_rank(tp_rank, tp_size)  # validates tp_rank / tp_size
    side = ops.make_side(caches, spec, [], 0)
    if side.num_heads != spec.heads_per_rank(tp_size):
        raise ValueError(
            f"caches: hold {side.num_heads} heads per layer, tp_size={tp_size} needs "
            f"{spec.heads_per_rank(tp_size)}"
        )
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"engine_id: must be a non-empty string, got {engine_id!r}")
    if transport not in ("auto", *TRANSPORTS):
        raise ValueError(f"transport: must be 'auto', 'ipc', 'pg' or 'nixl', got {transport!r}")
    if transport == "nixl":
        require_nixl()  # NixlUnavailable (an ImportError) naming how to install it
    if not (isinstance(lease_s, (int, float)) and 0 < lease_s < MAX_LEASE_S):
        raise ValueError(f"lease_s: must be > 0 and < {MAX_LEASE_S:.0f} seconds, got {lease_s!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535 - tp_size:
        raise ValueError(f"port: must be an int in [0, {65535 - tp_size}], got {port!r}")
    if port == 0 and tp_size > 1:
        raise ValueError("port: a tp_size > 1 engine needs an explicit base port (rank r binds port + r)")
    if pipeline is not None and not isinstance(pipeline, StagedPipeline):
        raise ValueError(f"pipeline: expected a StagedPipeline or None, got {type(pipeline).__name__}")
    if auth_key is not None and (not isinstance(auth_key, str) or not auth_key):
        raise ValueError("auth_key: must be a non-empty string or None")
    if not isinstance(onesided, bool):
        raise ValueError(f"onesided: must be a bool, got {onesided!r}")
    gs = None if groups is None else GroupSet(groups, spec.num_layers, null_block)
    for g in () if gs is None else gs.states:
        g.check_pages(spec.bytes_per_token(spec.heads_per_rank(tp_size), 1) * spec.block_size, tp_size)
    return side, gs


def windows_end(computed: int | None, num_tokens: int) -> int:
    """``computed`` (an engine call's ``computed_tokens``) checked to be in ``[1, num_tokens]``
    (default ``num_tokens``)."""
    if computed is None:
        return num_tokens
    c = computed
    if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= num_tokens:
        raise ValueError(f"computed_tokens: must be an int in [1, {num_tokens}], got {c!r}")
    return c


def layer_mask(layers, num_layers: int) -> np.ndarray:
    """:meth:`~kvxfer.engine.TransferEngine.mark_ready`'s ``layers`` (an int, a range or a
    sequence of layer indices), checked: in ``[0, num_layers)``, none repeated, at least one;
    as a bool mask of ``num_layers``."""
    L = num_layers
    if isinstance(layers, bool):
        raise ValueError(f"layers: must be layer indices, got {layers!r}")
    idx = [layers] if isinstance(layers, int) else list(layers)
    if not idx or not all(isinstance(x, int) and not isinstance(x, bool) for x in idx):
        raise ValueError(f"layers: must be a non-empty set of layer indices, got {layers!r}")
    bad = [x for x in idx if not 0 <= x < L]
    if bad:
        raise ValueError(f"layers: layer {bad[0]} out of range [0, {L})")
    if len(set(idx)) != len(idx):
        raise ValueError(f"layers: repeated layer index in {idx}")
    mask = np.zeros(L, dtype=bool)
    mask[idx] = True
    return mask


def export_ids_of(
    engine, request_id: str, block_ids, num_tokens: int, computed_tokens: int | None
) -> tuple[np.ndarray, list[int] | None, list | None]:
    """``TransferEngine.export``'s arguments checked against ``engine`` (its ``groups``,
    ``spec`` and ``num_blocks``): (the ids held, ids per group or None, the list of exactly
    those ids when ``block_ids`` is a list and the engine has no groups, else None)."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens: must be a positive int, got {num_tokens!r}")
    if engine.groups is not None:
        end = windows_end(computed_tokens, num_tokens)
        ids, sizes = export_ids(
            engine.groups, block_ids, num_tokens, engine.spec.block_size, engine.num_blocks, end
        )
        return ids, sizes, None  # the params list the live ids
    need = engine.spec.num_blocks_for(num_tokens)
    listed = block_ids[:need] if type(block_ids) is list else None  # the params carry exactly these
    ids = check_block_ids(
        listed if listed is not None else block_ids, need, engine.num_blocks, num_tokens, True
    )
    return ids, None, listed
