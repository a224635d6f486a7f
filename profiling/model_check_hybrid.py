"""Hybrid models' caches through kvxfer's ops: every group (GDN or Mamba2 state, full attention,
sliding window) of a transformers model prefilled on P, laid out as vLLM-like pages at P's TP,
moved into D's pages at another TP, attention layout, block size, conv layout and GDN SSM order,
and D's next-token log-probabilities set against a plain run's.

Models (tiny, random weights, fp32, CPU; ``docs/research/vllm-hybrid.md`` §5): Qwen3-Next (Gated
DeltaNet + full attention), GraniteMoeHybrid (Mamba2 with one group, replicated under TP, +
full attention) and Gemma-3 (sliding window + full attention). Each runs P TP 2 -> D TP 1 (the
state through a wire: ``gather_state`` / ``scatter_state``; attention ``gather_blocks`` /
``scatter_blocks``) and P TP 1 -> D TP 2 (``copy_state``, ``copy_blocks``).

Each engine rank holds one byte buffer, layer-outer as vLLM 0.32 places a hybrid model's cache
(``KVCacheTensor``): every group's ``j``-th layer shares region ``j``, one page per block (the
largest group's page, the others padded), one block pool for all groups (block 0 the null
block). Views: attention ``[2, B, H, N, d]`` over LBHNC pages (P: HND, 8-token blocks) or
``[2, B, N, H, d]`` over LBNHC pages (D: NHD, 6-token blocks); a state layer ``[B, page]``
bytes, conv state then SSM state (P: SD, GDN ``[h, V, K]`` as on CUDA; D: DS, GDN ``[h, K, V]``
as on vLLM's CPU backend). A sliding-window group's list holds the null block where the window
has passed, on both sides; only the in-window tokens move (:func:`select_window_blocks`, token
slots).

P's pages are written from the HF cache, and D's read back into a fresh HF cache, by plain
indexing written here (vLLM's sharding: each conv part sliced by head or group per rank,
replicated when ``n_groups < tp``), independent of kvxfer's index math. The checks, per model
and direction: D's buffers byte-equal to the HF cache written straight into D's layout (every
other byte untouched), replicas on D's ranks equal, and D's next-token log-probabilities within
``--atol`` (1e-4) of the plain run of prompt plus that token with the same argmax. Mutations
(after the byte check): one layer's conv state x 1.01, its SSM state x 1.01, one in-window block
of a sliding layer x 1.01: each must fail the log-probability check.

    python profiling/model_check_hybrid.py [--models qwen3_next,granite,gemma3] [--tokens 37]

Prints the figures and one JSON line; exits 0 when every check held and every mutation failed
it. Needs ``transformers`` (the ``test`` extra brings it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch

from kvxfer import KVCacheSpec, Layout, plan_reads
from kvxfer.groups import (
    NULL_BLOCK,
    StateSpec,
    copy_state,
    gather_state,
    plan_state_reads,
    scatter_state,
    select_window_blocks,
)
from kvxfer.ops import copy_blocks, gather_blocks, register_caches, scatter_blocks

POISON = 0xA5
KV_HEADS, HEAD_DIM, VOCAB = 2, 16, 128


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


def model_and_config(name: str):
    """(transformers config, :class:`Model`). Weights are spread wider than transformers' default
    (``initializer_range``), so a 1 % change of one state moves the log-probabilities past the
    tolerance (measured with 37 tokens: at 0.02 Granite's SSM x 1.01 moved them by < 1e-5)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=256)  # fmt: skip
    if name == "qwen3_next":
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(
            num_hidden_layers=4, head_dim=HEAD_DIM, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            initializer_range=0.1, **common,
        )  # fmt: skip
        return cfg, Model(name, full=(3,), state=(0, 1, 2), parts=((2, 16, False), (2, 16, False), (4, 24, False)),
                          ssm_heads=4, gdn=True)  # fmt: skip
    if name == "granite":
        from transformers import GraniteMoeHybridConfig

        cfg = GraniteMoeHybridConfig(
            num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=8, mamba_n_groups=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
            position_embedding_type="rope", initializer_range=0.2, **common,
        )  # fmt: skip
        # x: 8 heads of 128/8 = 16; B, C: 1 group of d_state 16 (replicated under TP)
        return cfg, Model(name, full=(1, 3), state=(0, 2), parts=((8, 16, False), (1, 16, True), (1, 16, True)),
                          ssm_heads=8)  # fmt: skip
    if name == "gemma3":
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(num_hidden_layers=6, head_dim=HEAD_DIM, sliding_window=16, initializer_range=0.1,
                               **common)  # fmt: skip
        return cfg, Model(name, full=(5,), sliding=(0, 1, 2, 3, 4), window=16)
    raise ValueError(f"--models: unknown model {name!r} (qwen3_next, granite, gemma3)")


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


# ------------------------------------------------------------------------------ HF's cache
def extract(cache) -> list[dict]:
    """Per layer: ``k``/``v`` ``[1, H, n, d]`` (sliding: the last window - 1 tokens), ``conv``
    ``[1, C, k]`` and ``rec`` (HF order) for state layers."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    out = []
    for layer in cache.layers:
        e = {}
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            e["k"], e["v"] = layer.keys.clone(), layer.values.clone()
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            e["conv"], e["rec"] = layer.conv_states[0].clone(), layer.recurrent_states[0].clone()
            e["ksz"] = layer.conv_kernel_size[0]
        out.append(e)
    return out


def inject(model, ex: list[dict], num_tokens: int):
    """A fresh HF cache holding ``ex`` (the research doc's §5.3 recipe)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    fresh = DynamicCache(config=model.config)
    for layer, e in zip(fresh.layers, ex):
        if "k" in e:
            layer.lazy_initialization(e["k"], e["v"])
            layer.keys, layer.values = e["k"].clone(), e["v"].clone()
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = num_tokens
        if "conv" in e:
            layer.lazy_initialization(conv_states=e["conv"], state_idx=0, conv_kernel_size=e["ksz"])
            layer.conv_states[0].copy_(e["conv"])
            layer.lazy_initialization(recurrent_states=e["rec"], state_idx=0)
            layer.recurrent_states[0].copy_(e["rec"])
            layer.has_previous_state[0] = True
    return fresh


# ---------------------------------------------------------------------- one engine's pages
def owned(num_units: int, tp: int, rank: int) -> list[int]:
    """vLLM's sharding of ``num_units`` heads/groups: a contiguous share, or (fewer units than
    ranks) one replicated unit."""
    if num_units >= tp:
        per = num_units // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * num_units // tp]


class Engine:
    """One engine's ranks: their buffers, the groups' views over them and the request's block
    lists (see the module doc)."""

    def __init__(self, m: Model, tp: int, block_size: int, layout: Layout, conv_layout: str, transposed: bool,
                 num_tokens: int, seed: int) -> None:  # fmt: skip
        self.m, self.tp, self.bs, self.layout = m, tp, block_size, layout
        self.heads = KV_HEADS // tp
        attn_page = self.heads * block_size * 2 * HEAD_DIM * 4
        self.state_spec = None
        page = attn_page
        if m.state:
            content = state_spec(m, tp, conv_layout, transposed, None).content_bytes
            page = max(page, -(-content // 64) * 64)
            self.state_spec = state_spec(m, tp, conv_layout, transposed, page)
        self.page = page
        nb_req = -(-num_tokens // block_size)
        self.num_blocks = 1 + 2 * nb_req + 1 + 5  # null, full, sliding, state, spare
        g = torch.Generator().manual_seed(seed)
        pool = (torch.randperm(self.num_blocks - 1, generator=g) + 1).tolist()  # block 0: the null block
        self.full_ids = pool[:nb_req]
        first = max(0, num_tokens - m.window + 1) if m.window else 0
        self.sliding_ids = [NULL_BLOCK if (i + 1) * block_size <= first else b for i, b in
                            enumerate(pool[nb_req : 2 * nb_req])]  # fmt: skip
        self.state_id = pool[2 * nb_req]
        regions = max(len(m.full), len(m.sliding), len(m.state))
        self.region_bytes = self.num_blocks * page
        self.bufs = [torch.full((regions * self.region_bytes,), POISON, dtype=torch.uint8) for _ in range(tp)]
        self.full_spec = KVCacheSpec(len(m.full), KV_HEADS, HEAD_DIM, block_size, torch.float32, layout)
        self.sliding_spec = (
            KVCacheSpec(len(m.sliding), KV_HEADS, HEAD_DIM, block_size, torch.float32, layout)
            if m.sliding
            else None
        )

    def attn_views(self, rank: int, num_layers: int) -> list[torch.Tensor]:
        """kvxfer views ``[2, B, H, N, d]`` (HND over LBHNC pages) or ``[2, B, N, H, d]`` (NHD
        over LBNHC) of regions ``0..num_layers-1``."""
        f = self.bufs[rank].view(torch.float32)
        pe, h, n, d = self.page // 4, self.heads, self.bs, HEAD_DIM
        if self.layout is Layout.HND:  # page [H, N, 2d]
            shape, stride = (2, self.num_blocks, h, n, d), (d, pe, n * 2 * d, 2 * d, 1)
        else:  # page [N, H, 2d]
            shape, stride = (2, self.num_blocks, n, h, d), (d, pe, h * 2 * d, 2 * d, 1)
        return [torch.as_strided(f, shape, stride, j * self.region_bytes // 4) for j in range(num_layers)]

    def state_views(self, rank: int) -> list[torch.Tensor]:
        """Per state layer: ``[B, page]`` bytes of its region."""
        b = self.bufs[rank]
        return [b[j * self.region_bytes : (j + 1) * self.region_bytes].view(self.num_blocks, self.page)
                for j in range(len(self.m.state))]  # fmt: skip

    # ------------------------------------------------------------- plain indexing, both ways
    def _rows(self, view: torch.Tensor, kv: int, block: int, row: int) -> torch.Tensor:
        """``[H_local, d]`` of one token row of one block."""
        return view[kv, block, :, row] if self.layout is Layout.HND else view[kv, block, row]

    def write(self, ex: list[dict], num_tokens: int) -> None:
        """Lay the HF cache ``ex`` out as this engine's pages (see the module doc)."""
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


# ------------------------------------------------------------------------------- the move
def move(p: Engine, d: Engine, num_tokens: int, wire: bool) -> dict[str, int]:
    """Every group of the request from P's ranks into D's with kvxfer's ops; bytes moved per
    group. ``wire``: gather/scatter through wires, else the fused copies."""
    m, moved = p.m, {}
    if m.state:
        plan = plan_state_reads(p.state_spec, d.state_spec)
        moved["state"] = 0
        for dr in range(d.tp):
            for read in plan.reads(dr):
                src = p.state_views(read.src_rank)
                if wire:
                    w = gather_state(src, p.state_spec, [p.state_id], read.runs)
                    scatter_state(
                        w, d.state_views(dr), d.state_spec, [d.state_id], read.runs, wire_spec=p.state_spec
                    )
                else:
                    copy_state(
                        src,
                        p.state_spec,
                        [p.state_id],
                        d.state_views(dr),
                        d.state_spec,
                        [d.state_id],
                        read.runs,
                    )
                counts = [r.num_units for r in read.runs]
                moved["state"] += p.state_spec.wire_layout(counts, num_states=1).nbytes
    plan = plan_reads(p.full_spec, p.tp, d.full_spec, d.tp)
    moved["full"] = 0
    for dr in range(d.tp):
        dst = d.attn_views(dr, len(m.full))
        for r in plan.reads(dr):
            src = p.attn_views(r.src_rank, len(m.full))
            if wire:
                w = gather_blocks(src, p.full_spec, p.full_ids, num_tokens, r.src_head_start, r.num_heads)
                scatter_blocks(w, dst, d.full_spec, d.full_ids, num_tokens, r.dst_head_start)
            else:
                copy_blocks(src, p.full_spec, p.full_ids, dst, d.full_spec, d.full_ids, num_tokens,
                            r.src_head_start, r.dst_head_start, r.num_heads)  # fmt: skip
            moved["full"] += p.full_spec.bytes_per_token(r.num_heads) * num_tokens
    if m.sliding:
        sel = select_window_blocks(p.sliding_ids, d.sliding_ids, num_tokens, m.window, p.bs, d.bs)
        src_ranks = [register_caches(p.attn_views(r, len(m.sliding)), p.sliding_spec, token_slots=True)
                     for r in range(p.tp)]  # fmt: skip
        plan = plan_reads(src_ranks[0].spec, p.tp, src_ranks[0].spec, d.tp)
        moved["sliding"] = 0
        for dr in range(d.tp):
            dst = register_caches(d.attn_views(dr, len(m.sliding)), d.sliding_spec, token_slots=True)
            for r in plan.reads(dr):
                src = src_ranks[r.src_rank]
                copy_blocks(src, src.spec, sel.src_slots(), dst, dst.spec, sel.dst_slots(), sel.num_window_tokens,
                            r.src_head_start, r.dst_head_start, r.num_heads)  # fmt: skip
                moved["sliding"] += p.sliding_spec.bytes_per_token(r.num_heads) * sel.num_window_tokens
        moved["sliding_all_blocks"] = p.sliding_spec.bytes_per_token() * num_tokens
    return moved


def mutate(d: Engine, what: str) -> str:
    """1 % off in D's pages: one state layer's conv or SSM state (every rank's share), or the
    last in-window block of a sliding layer (K and V, every rank's heads). Returns what."""
    m = d.m
    if what in ("conv", "ssm"):
        spec = d.state_spec
        lo, hi = (0, spec.conv_bytes) if what == "conv" else (spec.conv_bytes, spec.content_bytes)
        for r in range(d.tp):
            d.state_views(r)[0][d.state_id, lo:hi].view(torch.float32).mul_(1.01)
        return f"layer {m.state[0]}'s {what} state x 1.01"
    block = d.sliding_ids[-1]
    for r in range(d.tp):
        d.attn_views(r, len(m.sliding))[0][:, block].mul_(1.01)
    return f"layer {m.sliding[0]}'s last in-window block (id {block}, K and V) x 1.01"


# ------------------------------------------------------------------------------ the check
def check_model(name: str, num_tokens: int, atol: float, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg, m = model_and_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (1, num_tokens), generator=g)
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        ex = extract(out.cache)
        full = torch.cat([prompt, torch.tensor([[token]])], dim=1)
        ref = torch.log_softmax(model(full).logits[0, -1].double(), -1)

    def decode(cache_ex) -> torch.Tensor:
        with torch.no_grad():
            logits = model(
                torch.tensor([[token]]), cache=inject(model, cache_ex, num_tokens), use_cache=True
            ).logits
        return torch.log_softmax(logits[0, -1].double(), -1)

    res = {"model": name, "tokens": num_tokens, "directions": []}
    mutations = (["conv", "ssm"] if m.state else []) + (["window"] if m.sliding else [])
    for p_tp, d_tp, wire in ((2, 1, True), (1, 2, False)):
        p = Engine(m, p_tp, 8, Layout.HND, "SD", False, num_tokens, seed + 1)
        d = Engine(m, d_tp, 6, Layout.NHD, "DS", True, num_tokens, seed + 2)
        p.write(ex, num_tokens)
        want = Engine(m, d_tp, 6, Layout.NHD, "DS", True, num_tokens, seed + 2)
        want.write(ex, num_tokens)  # HF's cache straight into D's layout: what D must hold
        p_before = [b.clone() for b in p.bufs]
        moved = move(p, d, num_tokens, wire)
        bytes_exact = all(torch.equal(a, b) for a, b in zip(d.bufs, want.bufs))
        p_untouched = all(torch.equal(a, b) for a, b in zip(p.bufs, p_before))
        got, problems = d.read(num_tokens, ex)
        lp = decode(got)
        diff = float((lp - ref).abs().max())
        argmax = int(lp.argmax()) == int(ref.argmax())
        held = diff <= atol and argmax and bytes_exact and p_untouched and not problems
        row = {
            "p": f"TP{p_tp} HND/{p.bs}" + (" SD" if m.state else "") + (" [h,V,K]" if m.gdn else ""),
            "d": f"TP{d_tp} NHD/{d.bs}" + (" DS" if m.state else "") + (" [h,K,V]" if m.gdn else ""),
            "ops": "gather/scatter" if wire else "copy",
            "max_abs_logprob_diff": diff,
            "argmax_equal": argmax,
            "bytes_exact": bytes_exact,
            "p_untouched": p_untouched,
            "replica_problems": problems,
            "bytes_moved": moved,
            "held": held,
            "mutations": {},
        }
        clean = [b.clone() for b in d.bufs]
        for what in mutations:
            label = mutate(d, what)
            got, _ = d.read(num_tokens, ex)
            mdiff = float((decode(got) - ref).abs().max())
            row["mutations"][what] = {"what": label, "max_abs_logprob_diff": mdiff, "failed": mdiff > atol}
            for b, c in zip(d.bufs, clean):
                b.copy_(c)
        res["directions"].append(row)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3_next,granite,gemma3", help="comma-separated")
    p.add_argument("--tokens", type=int, default=37, help="prompt tokens P prefills")
    p.add_argument("--atol", type=float, default=1e-4, help="largest |log-probability difference| allowed")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    results = [check_model(name, a.tokens, a.atol, a.seed) for name in a.models.split(",") if name]
    ok = True
    for res in results:
        for row in res["directions"]:
            mut = ", ".join(f"{k} {v['max_abs_logprob_diff']:.2e} ({'fails' if v['failed'] else 'HELD'})"
                            for k, v in row["mutations"].items())  # fmt: skip
            print(
                f"{res['model']:10s} {row['p']:>22s} -> {row['d']:22s} {row['ops']:15s} "
                f"max|dlogp| {row['max_abs_logprob_diff']:.2e} argmax {'=' if row['argmax_equal'] else '!='} "
                f"bytes {'exact' if row['bytes_exact'] else 'DIFFER'} -> {'held' if row['held'] else 'FAILED'}; "
                f"mutations: {mut}"
            )
            ok &= row["held"] and all(v["failed"] for v in row["mutations"].values())
    print("check " + ("held" if ok else "FAILED") + f" (atol {a.atol}, {a.tokens} tokens)")
    print(json.dumps({"ok": ok, "atol": a.atol, "results": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
