"""The validated description of one side of a transfer, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PagedSide", "ids_tensor"]


def ids_tensor(side: PagedSide) -> torch.Tensor:
    """``side.block_ids`` as an int64 CPU tensor (a copy when the array is read-only: torch
    warns on those), for the backends that index with torch."""
    ids = side.block_ids
    return torch.from_numpy(ids if ids.flags.writeable else ids.copy())


@dataclass(slots=True)  # not frozen: a frozen init sets each field through object.__setattr__
class PagedSide:
    """One rank's paged cache, reduced to what a copy kernel needs.

    The cache of layer ``l`` (``caches[l]``, already restricted to the selected layers, in
    wire order) holds the row of ``head_dim`` contiguous elements for (kv, block, token, head)
    at element offset ``kv*stride_kv + block*stride_block + token*stride_token +
    head*stride_head``. NHD, HND and MLA differ only in these strides (MLA: ``num_kv=1``,
    ``stride_kv=0``, one head with ``stride_head=0``). All layers share shape and strides.

    Token ``t`` of the request lives in block ``block_ids[t // block_size]`` at offset
    ``t % block_size``. With ``slot_block > 1`` (a cache registered with ``token_slots``; then
    ``block_size == 1``) the ids are token slots instead: token ``t`` lives at slot
    ``s = block_ids[t]``, in block ``s // slot_block`` at offset ``s % slot_block``. One formula
    covers both: id ``i = block_ids[t // block_size]``, block ``i // slot_block``, offset
    ``t % block_size + i % slot_block`` (one of the two divisors is 1). ``block_ids`` holds
    exactly ``ceil(num_tokens / block_size)`` ids, all in ``[0, num_blocks)`` (slots: ``num_blocks``
    counts slots, blocks times ``slot_block``), as a C-contiguous int64 numpy array (read it in place; it may be
    read-only: :func:`ids_tensor` gives a tensor). numpy, not torch: the sides are made per
    ops call, and a torch call on them costs more host time than the backends' use of the
    ids (their address or values) is worth.
    """

    caches: tuple[torch.Tensor, ...]
    block_ids: np.ndarray
    num_tokens: int
    block_size: int
    num_blocks: int
    head_start: int
    num_heads: int
    head_dim: int
    num_kv: int
    stride_kv: int
    stride_block: int
    stride_token: int
    stride_head: int
    layout: str  # "NHD", "HND" or "MLA"
    # What a backend derives from everything but the block ids and token count, kept across
    # calls: the sides ops makes from one registered cache's template share the template's
    # dict (None for a side made once). A backend keys its entry by its name.
    memo: dict | None = None
    # The SM budget of the call (:func:`kvxfer.ops.gather_blocks` ``max_sms=``, or the registered
    # caches'): the Triton and CUDA C++ backends launch at most this many CTAs (persistent
    # programs striding over the work); None: one full wave (Triton: one program per tile).
    # Set by ops per call, never part of a template's memo.
    max_sms: int | None = None
    # Tokens per physical block when the ids are token slots (see above); 1: they are block ids.
    slot_block: int = 1

    def kept(self, name: str, make):
        """``make(self)``, kept in :attr:`memo` under ``name`` when this side has a memo (made
        anew for a side made once). ``make`` must depend on nothing but what the sides of one
        template share: not the block ids or the token count."""
        memo = self.memo
        if memo is None:
            return make(self)
        got = memo.get(name)
        if got is None:
            got = memo[name] = make(self)
        return got

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    @property
    def element_size(self) -> int:
        return self.caches[0].element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one head row (``head_dim`` elements)."""
        return self.head_dim * self.element_size

    def layer_ptrs(self) -> list[int]:
        """Base address of each selected layer's tensor."""
        return [c.data_ptr() for c in self.caches]

    def wire_view_shape(self) -> tuple[int, int, int, int, int]:
        """``(H, L, KV, T, D)``: the wire seen with MLA folded into the attention shape."""
        return (self.num_heads, self.num_layers, self.num_kv, self.num_tokens, self.head_dim)
