"""The hybrid models' groups and one engine's vLLM-like pages over them, for
``profiling/model_check_hybrid.py`` (whose module doc describes the layout).

:class:`Model` names a model's layers by kind and its state's shape; :class:`Pages` is one
engine's ranks: their byte buffers (layer-outer regions, one page per block, block 0 the null
block), the attention and state views over them, the engine's groups and the request's block
lists, and the plain indexing (vLLM's sharding, written here, independent of kvxfer's index
math) that lays HF's cache out as pages and reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvxfer import AttentionGroup, KVCacheSpec, Layout, StateGroup, StateSpec
from kvxfer.groups import NULL_BLOCK

POISON, GARBAGE = 0xA5, 0x5A  # D's bytes before the load; P's bytes no cache row holds
KV_HEADS, HEAD_DIM = 2, 16


# ------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class Model:
    """A model's groups: layers by kind, the state's conv parts (units, unit width, replicated
    under TP) and SSM heads, the GDN flag (HF's SSM is ``[h, K, V]``, vLLM's canonical
    ``[h, V, K]``), the sliding window."""

    name: str
    full: tuple[int, ...]
    sliding: tuple[int, ...] = ()
    state: tuple[int, ...] = ()
    parts: tuple[tuple[int, int, bool], ...] = ()
    ssm_heads: int = 0
    gdn: bool = False
    window: int = 0
    conv_kernel: int = 4

    @property
    def num_layers(self) -> int:
        return len(self.full) + len(self.sliding) + len(self.state)


def state_spec(m: Model, tp: int, conv_layout: str, transposed: bool, page: int | None) -> StateSpec:
    """The model's state group as an engine with these settings holds it."""
    (q, _, v) = m.parts
    if m.gdn:
        return StateSpec.gdn(
            num_layers=len(m.state), num_k_heads=q[0], num_v_heads=v[0], head_k_dim=q[1], head_v_dim=v[1],
            conv_kernel=m.conv_kernel, conv_dtype=torch.float32, tp_size=tp, conv_layout=conv_layout,
            ssm_transposed=transposed, page_size_bytes=page,
        )  # fmt: skip
    return StateSpec.mamba2(
        num_layers=len(m.state), num_heads=q[0], head_dim=q[1], n_groups=v[0], d_state=v[1],
        conv_kernel=m.conv_kernel, conv_dtype=torch.float32, tp_size=tp, conv_layout=conv_layout,
        page_size_bytes=page,
    )  # fmt: skip


# ---------------------------------------------------------------------- one engine's pages
def owned(num_units: int, tp: int, rank: int) -> list[int]:
    """vLLM's sharding of ``num_units`` heads/groups: a contiguous share, or (fewer units than
    ranks) one replicated unit."""
    if num_units >= tp:
        per = num_units // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * num_units // tp]


def window_first(m: Model, num_tokens: int) -> int:
    """The first token the next one attends to through the sliding window (HF keeps the last
    ``window - 1``)."""
    return max(0, num_tokens - m.window + 1)


class Pages:
    """One engine's ranks: their buffers, the views over them, the engine's groups and the
    request's block lists (see ``model_check_hybrid.py``'s module doc). ``step``: the block size
    is the smallest multiple of it whose block holds a state layer's content; ``fill``: every
    byte before any is written."""

    def __init__(self, m: Model, tp: int, step: int, layout: Layout, conv_layout: str, transposed: bool,
                 num_tokens: int, seed: int, fill: int) -> None:  # fmt: skip
        self.m, self.tp, self.layout = m, tp, layout
        self.heads = KV_HEADS // tp
        per_token = 2 * self.heads * HEAD_DIM * 4  # K and V of one token, one layer, one rank
        need = 1
        if m.state:
            need = -(-state_spec(m, tp, conv_layout, transposed, None).content_bytes // per_token)
        self.bs = -(-need // step) * step
        self.page = self.bs * per_token
        self.state_spec = state_spec(m, tp, conv_layout, transposed, self.page) if m.state else None
        nb_req = -(-num_tokens // self.bs)
        self.num_blocks = 1 + 2 * nb_req + 1 + 5  # null, full, sliding, state, spare
        g = torch.Generator().manual_seed(seed)
        pool = (torch.randperm(self.num_blocks - 1, generator=g) + 1).tolist()  # block 0: the null block
        self.full_ids = pool[:nb_req]
        dead = window_first(m, num_tokens) // self.bs if m.window else 0
        self.sliding_ids = [NULL_BLOCK] * dead + pool[nb_req + dead : 2 * nb_req]
        self.state_id = pool[2 * nb_req]
        self.region_of = {x: j for layers in (m.full, m.sliding, m.state) for j, x in enumerate(layers)}
        self.regions = max(len(m.full), len(m.sliding), len(m.state))
        self.bufs = [torch.full((self.regions, self.num_blocks, self.page), fill, dtype=torch.uint8)
                     for _ in range(tp)]  # fmt: skip
        self.spec = KVCacheSpec(m.num_layers, KV_HEADS, HEAD_DIM, self.bs, torch.float32, layout)

    def groups(self) -> list:
        """The engine's groups, in the order of :meth:`block_lists`."""
        m = self.m
        out: list = [AttentionGroup(m.full)]
        if m.sliding:
            out.append(AttentionGroup(m.sliding, window=m.window))
        if m.state:
            out.append(StateGroup(m.state, self.state_spec))
        return out

    def block_lists(self) -> list[list[int]]:
        """The request's positional block list per group."""
        m = self.m
        return (
            [self.full_ids]
            + ([self.sliding_ids] if m.sliding else [])
            + ([[self.state_id]] if m.state else [])
        )

    def attn_views(self, rank: int, num_layers: int) -> list[torch.Tensor]:
        """Attention views ``[2, B, H, N, d]`` (HND) or ``[2, B, N, H, d]`` (NHD) of regions
        ``0..num_layers-1``: block ``b`` is page ``b``, K then V."""
        h, n, d = self.heads, self.bs, HEAD_DIM
        inner = (2, h, n, d) if self.layout is Layout.HND else (2, n, h, d)
        return [self.bufs[rank][j].view(torch.float32).view(self.num_blocks, *inner).transpose(0, 1)
                for j in range(num_layers)]  # fmt: skip

    def caches(self, rank: int) -> list[torch.Tensor]:
        """The engine's ``caches``: per layer, its region's attention view."""
        views = self.attn_views(rank, self.regions)
        return [views[self.region_of[x]] for x in range(self.m.num_layers)]

    def state_views(self, rank: int) -> list[torch.Tensor]:
        """Per state layer: ``[B, page]`` bytes of its region."""
        return [self.bufs[rank][j] for j in range(len(self.m.state))]

    # ------------------------------------------------------------- plain indexing, both ways
    def _rows(self, view: torch.Tensor, kv: int, block: int, row: int) -> torch.Tensor:
        """``[H_local, d]`` of one token row of one block."""
        return view[kv, block, :, row] if self.layout is Layout.HND else view[kv, block, row]

    def write(self, ex: list[dict], num_tokens: int) -> None:
        """Lay the HF cache ``ex`` out as this engine's pages (see ``model_check_hybrid.py``'s
        module doc)."""
        m = self.m
        for r in range(self.tp):
            heads = owned(KV_HEADS, self.tp, r)
            for layers, ids, lo in ((m.full, self.full_ids, 0), (m.sliding, self.sliding_ids, None)):
                views = self.attn_views(r, len(layers))
                for j, layer in enumerate(layers):
                    k, v = ex[layer]["k"][0], ex[layer]["v"][0]  # [H, n, d]: the last n tokens
                    start = num_tokens - k.shape[1] if lo is None else lo
                    for t in range(start, num_tokens):
                        blk, row = ids[t // self.bs], t % self.bs
                        self._rows(views[j], 0, blk, row).copy_(k[heads, t - start])
                        self._rows(views[j], 1, blk, row).copy_(v[heads, t - start])
            if m.state:
                spec = self.state_spec
                for j, layer in enumerate(m.state):
                    conv, ssm = self._rank_state(ex[layer], r)
                    page = self.state_views(r)[j][self.state_id]
                    page[: spec.conv_bytes].view(torch.float32).copy_(conv.reshape(-1))
                    page[spec.conv_bytes : spec.content_bytes].view(torch.float32).copy_(ssm.reshape(-1))

    def carry_before_window(self, src: Pages, num_tokens: int) -> None:
        """The sliding rows a move carries from ``src``'s blocks before the window's first token
        (``docs/DESIGN.md``: from the start of the later of the two sides' blocks holding it):
        ``src``'s bytes there, garbage, as this engine's rows."""
        if not self.m.sliding:
            return
        first = window_first(self.m, num_tokens)
        lo = max(first // self.bs * self.bs, first // src.bs * src.bs)
        for r in range(self.tp):
            for view in self.attn_views(r, len(self.m.sliding)):
                for t in range(lo, first):
                    for kv in (0, 1):
                        self._rows(view, kv, self.sliding_ids[t // self.bs], t % self.bs).view(
                            torch.uint8
                        ).fill_(GARBAGE)

    def _rank_state(self, e: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One rank's conv state (this engine's layout) and SSM state (its order) from HF's."""
        conv = e["conv"][0, :, 1:]  # [C, k-1]: vLLM keeps k-1 columns (HF's oldest is unused)
        chans, pos = [], 0
        for units, width, _ in self.m.parts:
            part = conv[pos : pos + units * width].view(units, width, -1)
            chans.append(part[owned(units, self.tp, rank)].reshape(-1, conv.shape[1]))
            pos += units * width
        local = torch.cat(chans)  # [C_local, k-1]
        if self.state_spec.conv_layout.value == "SD":
            local = local.T
        rec = e["rec"][0]  # HF: Mamba2 [h, head_dim, d_state]; GDN [h, K, V]
        if self.m.gdn and not self.state_spec.ssm_transposed:
            rec = rec.transpose(-1, -2)  # vLLM's CUDA order [h, V, K]
        return local.contiguous(), rec[owned(self.m.ssm_heads, self.tp, rank)].contiguous()

    def read(self, num_tokens: int, template: list[dict]) -> tuple[list[dict], list[str]]:
        """D's pages back as an HF cache (shaped like ``template``), and any disagreement between
        replicas of one unit on different ranks."""
        m, out, problems = self.m, [{} for _ in template], []
        for layers, ids in ((m.full, self.full_ids), (m.sliding, self.sliding_ids)):
            for j, layer in enumerate(layers):
                n = template[layer]["k"].shape[2]
                k = torch.empty(1, KV_HEADS, n, HEAD_DIM)
                v = torch.empty_like(k)
                for r in range(self.tp):
                    view = self.attn_views(r, len(layers))[j]
                    heads = owned(KV_HEADS, self.tp, r)
                    for i, t in enumerate(range(num_tokens - n, num_tokens)):
                        k[0, heads, i] = self._rows(view, 0, ids[t // self.bs], t % self.bs)
                        v[0, heads, i] = self._rows(view, 1, ids[t // self.bs], t % self.bs)
                out[layer]["k"], out[layer]["v"] = k, v
        for j, layer in enumerate(m.state):
            conv = torch.zeros_like(template[layer]["conv"])
            rec = torch.empty_like(template[layer]["rec"])
            seen: dict[tuple[int, int], torch.Tensor] = {}
            spec = self.state_spec
            for r in range(self.tp):
                page = self.state_views(r)[j][self.state_id]
                local = page[: spec.conv_bytes].view(torch.float32).view(spec.conv_shape)
                if spec.conv_layout.value == "SD":
                    local = local.T
                pos, lpos = 0, 0
                for p, (units, width, _) in enumerate(m.parts):
                    mine = owned(units, self.tp, r)
                    for i, u in enumerate(mine):
                        got = local[lpos + i * width : lpos + (i + 1) * width]
                        if (p, u) in seen and not torch.equal(seen[(p, u)], got):
                            problems.append(f"layer {layer} conv part {p} unit {u}: replicas differ on D")
                        seen[(p, u)] = got
                        conv[0, pos + u * width : pos + (u + 1) * width, 1:] = got
                    pos += units * width
                    lpos += len(mine) * width
                heads = owned(m.ssm_heads, self.tp, r)
                ssm = page[spec.conv_bytes : spec.content_bytes].view(torch.float32).view(spec.ssm_shape)
                if m.gdn and not spec.ssm_transposed:
                    ssm = ssm.transpose(-1, -2)
                rec[0, heads] = ssm
            out[layer].update(conv=conv, rec=rec, ksz=template[layer]["ksz"])
        return out, problems
