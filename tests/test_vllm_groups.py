"""Tier 1: the vLLM connector with several KV cache groups (vLLM's hybrid allocator on), against
fakes of vLLM's objects and real engines.

Three groups over one block pool, as vLLM 0.32 lays out a Gemma-style model: full attention,
a window of 40 and a window of 20 tokens; the j-th layers of all groups share one tensor, each
group its own blocks of it; block lists are positional, the null block 0 where a window passed
(docs/research/vllm-hybrid.md §1.4, §2). P's scheduler makes the params from its per-group
lists, D loads into its own; D's attention kernels must read exactly P's rows for every token
each group still needs (one more than the window: D computes the last prompt token again),
and every other block of D stays poison (its null block included).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import pytest
import torch

from kvxfer.ports import free_port_base
from kvxfer.vllm.config import ConnectorConfig
from kvxfer.vllm.groups import HybridModelUnsupported, VllmGroup, expand_group_ids, groups_from_config
from kvxfer.vllm.scheduler import SchedulerSide
from kvxfer.vllm.worker import WorkerSide

from .vllm_fakes import (
    Request,
    Status,
    cpu_cache,
    cpu_vec_read,
    fa_cache,
    fa_kernel_kv,
    token_rows,
    vllm_config,
)

HEADS, HD = 4, 16
POISON = -7.0
NAMES = [("a0", "a1"), ("b0", "b1"), ("c0", "c1")]  # group g's layers; the j-th share a tensor
WINDOWS = [None, 40, 20]
KINDS = {  # kind -> (cache factory, backend, isa, block size)
    "fa16": (lambda nb, h: fa_cache(nb, h, 16, HD, torch.bfloat16), "FLASH_ATTN", None, 16),
    "fa32": (lambda nb, h: fa_cache(nb, h, 32, HD, torch.bfloat16, "LBHNC"), "FLASH_ATTN", None, 32),
    "cpu32": (lambda nb, h: cpu_cache(nb, h, 32, HD, torch.bfloat16), "CPU_ATTN", "vec", 32),
}
NB = 24


class GroupBlocks:
    """``KVCacheBlocks`` with one positional list per group."""

    def __init__(self, lists):
        self.lists = [list(x) for x in lists]

    def get_block_ids(self):
        return tuple(list(x) for x in self.lists)


def _groups(bs: int) -> list[VllmGroup]:
    return [VllmGroup(i, names, w, 0, bs) for i, (names, w) in enumerate(zip(NAMES, WINDOWS))]


def _lists(first_id: int, n: int, bs: int) -> list[list[int]]:
    """vLLM-like lists: distinct ids from ``first_id``, the null block where the window passed
    (``get_num_skipped_tokens``: ``n - w + 1`` tokens)."""
    need = -(-n // bs)
    out, nxt = [], first_id
    for w in WINDOWS:
        dead = 0 if w is None else max(0, n - w + 1) // bs
        out.append([0] * dead + list(range(nxt, nxt + need - dead)))
        nxt += need
    return out


def _needed(n: int, g: int) -> int:
    """The first token D needs of group ``g``: its window for the recomputed last token."""
    return 0 if WINDOWS[g] is None else max(0, n - WINDOWS[g])


class Side:
    """One server: a SchedulerSide and a WorkerSide per TP rank over vLLM-like aliased caches."""

    def __init__(self, engine_id: str, role: str, tp: int, kind: str):
        make, backend, isa, bs = KINDS[kind]
        self.kind, self.bs, self.tp = kind, bs, tp
        port = free_port_base(tp) if role != "kv_consumer" else 15000
        self.cfg = ConnectorConfig.from_vllm(
            vllm_config(
                role=role, engine_id=engine_id, tp=tp, port=port, block_size=bs, extra={"timeout_s": 5.0}
            )
        )
        self.workers, self.tensors = [], []
        for r in range(tp):
            ts = [make(NB, HEADS // tp) for _ in range(2)]
            if role == "kv_consumer":
                for t in ts:
                    t.fill_(POISON)
            caches = {name: ts[j] for names in NAMES for j, name in enumerate(names)}
            w = WorkerSide(self.cfg, r, groups=_groups(bs))
            w.register(caches, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False, isa=isa)
            self.workers.append(w)
            self.tensors.append(ts)
        self.sched = SchedulerSide(self.cfg, groups=_groups(bs))
        self.sched.set_handshake({r: w.handshake_info() for r, w in enumerate(self.workers)})

    def step(self) -> dict[str, int]:
        meta = self.sched.build_connector_meta()
        done: dict[str, int] = {}
        for w in self.workers:
            w.start(meta)
        for w in self.workers:
            s, r = w.finished()
            for rid in s | r:
                done[rid] = done.get(rid, 0) + 1
        return done

    def close(self):
        for w in self.workers:
            w.close()


def _truth(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(2, n, HEADS, HD, generator=g).to(torch.bfloat16)
        for names in NAMES
        for name in names
    }


def _fill_p(p: Side, truth, lists, n: int) -> None:
    """P's rows at every position its lists hold (not the null block's)."""
    bs = p.bs
    for r in range(p.tp):
        h = HEADS // p.tp
        for g, names in enumerate(NAMES):
            live = [pos for pos, b in enumerate(lists[g]) if b]
            toks = [t for t in range(n) if t // bs in live]
            for j, name in enumerate(names):
                rows = truth[name][:, toks][:, :, r * h : (r + 1) * h]
                t = p.tensors[r][j]
                if p.kind == "cpu32":
                    _cpu_write_tokens(t, lists[g], toks, rows)
                else:
                    k, v = fa_kernel_kv(t, HD)
                    tt = torch.tensor(toks)
                    blk = torch.tensor(lists[g])[tt // bs]
                    k[blk, tt % bs] = rows[0]
                    v[blk, tt % bs] = rows[1]


def _cpu_write_tokens(t, positions, toks, rows):
    """ISA vec page writes of tokens ``toks`` (their rows ``[2, len, H, d]``) at ``positions``."""
    n_blk = t.shape[2]
    for i, tok in enumerate(toks):
        blk = positions[tok // n_blk]
        cpu_vec_write_one(t, blk, tok % n_blk, rows[0, i], rows[1, i])


def cpu_vec_write_one(t, blk, off, k, v):
    b, h, n, c = t.shape
    d = c // 2
    pages = t.view(b, h, 2 * n * d)
    pages[blk, :, off : n * d : n] = k
    pages[blk, :, n * d + off * d : n * d + (off + 1) * d] = v


def _check_d(d: Side, p: Side, truth, dlists, n: int) -> None:
    bs_d, bs_p = d.bs, p.bs
    need = -(-n // bs_d)
    for r in range(d.tp):
        h = HEADS // d.tp
        written = [set(), set()]
        for g, names in enumerate(NAMES):
            x = _needed(n, g)
            start = max(x // bs_d * bs_d, x // bs_p * bs_p)
            for j, name in enumerate(names):
                t = d.tensors[r][j]
                if d.kind == "cpu32":
                    k, v = cpu_vec_read(t, dlists[g], n)
                else:
                    kk, vv = fa_kernel_kv(t, HD)
                    k, v = token_rows(kk, dlists[g], n), token_rows(vv, dlists[g], n)
                want = truth[name][:, :, r * h : (r + 1) * h]
                assert torch.equal(k[start:].view(torch.int16), want[0, start:].view(torch.int16)), (
                    r,
                    g,
                    name,
                )
                assert torch.equal(v[start:].view(torch.int16), want[1, start:].view(torch.int16)), (
                    r,
                    g,
                    name,
                )
                written[j] |= set(dlists[g][start // bs_d : need])
        for j in range(2):
            t = d.tensors[r][j]
            others = [b for b in range(NB) if b not in written[j]]
            assert 0 in others
            assert bool((t[others] == POISON).all()), (
                f"rank {r} tensor {j}: a block no group writes was written"
            )


def _hand_over(p: Side, d: Side, n: int, seed: int = 3):
    truth = _truth(n, seed)
    plists = _lists(1, n, p.bs)
    dlists = _lists(1, n, d.bs)
    _fill_p(p, truth, plists, n)
    toks = list(range(n))
    preq = Request(
        "p-1", toks, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, num_computed_tokens=n
    )
    hold, params = p.sched.request_finished(preq, tuple(plists))
    return truth, plists, dlists, hold, params


def _run(p: Side, d: Side, n: int):
    truth, _, dlists, hold, params = _hand_over(p, d, n)
    assert hold and params["groups"], params
    dreq = Request("d-1", list(range(n)), json.loads(json.dumps(params)))
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (n, True)
    d.sched.update_state_after_alloc(dreq, GroupBlocks(dlists), n)
    d.step()
    p.step()
    end = time.monotonic() + 15
    got = {}
    while got.get("d-1", 0) < d.tp and time.monotonic() < end:
        for k, v in d.step().items():
            got[k] = got.get(k, 0) + v
        time.sleep(0.01)
    assert got.get("d-1") == d.tp, got
    assert not any(w.take_failed_loads() for w in d.workers)
    _check_d(d, p, truth, dlists, n)
    sent = {}
    while sent.get("p-1", 0) < p.tp and time.monotonic() < end:
        for k, v in p.step().items():
            sent[k] = sent.get(k, 0) + v
        time.sleep(0.01)
    assert sent.get("p-1") == p.tp
    assert all(w.engine.stats()["blocks_held"] == 0 for w in p.workers)


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "p_kind", "d_kind", "n"),
    [
        (1, 1, "fa16", "fa32", 75),
        (2, 1, "fa16", "fa32", 75),
        (1, 2, "fa16", "fa32", 61),
        (1, 1, "cpu32", "cpu32", 75),
        (1, 2, "cpu32", "cpu32", 75),
        (1, 1, "fa16", "fa16", 30),  # shorter than every window: nothing dead
    ],
)
def test_groups_p_to_d_exact(tp_p, tp_d, p_kind, d_kind, n):
    p = Side("P", "kv_producer", tp_p, p_kind)
    d = Side("D", "kv_consumer", tp_d, d_kind)
    try:
        _run(p, d, n)
    finally:
        p.close()
        d.close()


def test_window_needing_a_freed_block_is_not_handed_off(caplog):
    """n = 51, window 20, P blocks of 16: vLLM freed block 1 (tokens 16-31: the window of the
    next token starts at 32), but D computes token 50 again, which needs token 31: not handed
    off, naming the group."""
    p = Side("P", "kv_producer", 1, "fa16")
    try:
        with caplog.at_level(logging.WARNING):
            _, plists, _, hold, params = _hand_over(p, p, 51)
        assert plists[2][:2] == [0, 0]
        assert (hold, params) == (False, None)
        assert "not handed off (block_ids[2]: position 1 holds the null block" in caplog.text
    finally:
        p.close()


def test_params_of_other_groups_are_not_loaded(caplog):
    """D's model has other groups than P's params: recomputed (and released), not loaded."""
    p = Side("P", "kv_producer", 1, "fa16")
    d = SchedulerSide(
        ConnectorConfig.from_vllm(vllm_config(role="kv_consumer", engine_id="D", block_size=16))
    )
    d.layout = p.sched.layout
    try:
        _, _, _, hold, params = _hand_over(p, p, 40)
        assert hold
        dreq = Request("d-1", list(range(40)), params)
        with caplog.at_level(logging.WARNING):
            assert d.get_num_new_matched_tokens(dreq, 0) == (0, False)
        assert "the exporter's request is of 3 KV cache groups, this server's model has 1" in caplog.text
    finally:
        p.close()


# ----------------------------------------------------------------------------- config
@dataclass
class FullAttentionSpec:
    block_size: int = 16
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass
class SlidingWindowSpec:
    block_size: int = 16
    sliding_window: int = 32
    extra_retained_tokens: int = 0


@dataclass
class MLAAttentionSpec:
    block_size: int = 16


@dataclass
class MambaSpec:
    block_size: int = 16
    shapes: tuple = ((3, 64), (4, 16, 16))
    dtypes: tuple = ("float32", "float32")


@dataclass
class Group:
    layer_names: list
    kv_cache_spec: object
    enable_kv_transfer: bool = True


@dataclass
class Config:
    kv_cache_groups: list


def test_groups_from_config_carries_attention_and_names_what_it_refuses():
    one = Config([Group(["l0", "l1"], FullAttentionSpec())])
    assert groups_from_config(one) is None  # one full group: one list, as before
    swa = Config([Group(["l0", "l1"], SlidingWindowSpec(sliding_window=64))])
    (g,) = groups_from_config(swa)
    assert (g.index, g.window, g.layer_names) == (0, 64, ("l0", "l1"))  # all-sliding: carried
    gemma = Config(
        [Group([f"s{i}"], SlidingWindowSpec()) for i in range(5)] + [Group(["f0"], FullAttentionSpec())]
    )
    got = groups_from_config(gemma, "gemma")
    assert [x.window for x in got] == [32] * 5 + [None]
    mamba = Config([Group(["m0"], MambaSpec()), Group(["a0"], FullAttentionSpec())])  # no mamba_type
    with pytest.raises(
        HybridModelUnsupported,
        match=r"model qwen-next: KV cache group 0 \(MambaSpec.*state group not carried: state kind \?",
    ):
        groups_from_config(mamba, "qwen-next")
    chunked = Config(
        [Group(["c0"], FullAttentionSpec(attention_chunk_size=64)), Group(["a0"], SlidingWindowSpec())]
    )
    with pytest.raises(HybridModelUnsupported, match="chunked local attention"):
        groups_from_config(chunked)
    sizes = Config([Group(["a0"], FullAttentionSpec(16)), Group(["b0"], SlidingWindowSpec(32))])
    with pytest.raises(HybridModelUnsupported, match="different block sizes"):
        groups_from_config(sizes)
    mla = Config([Group(["a0"], MLAAttentionSpec()), Group(["b0"], SlidingWindowSpec())])
    with pytest.raises(HybridModelUnsupported, match="MLA in a model of several KV cache groups"):
        groups_from_config(mla)
    assert (
        groups_from_config(Config([Group(["a0", "a1"], MLAAttentionSpec())])) is None
    )  # MLA alone: as before
    off = Config(
        [Group(["a0"], FullAttentionSpec()), Group(["b0"], SlidingWindowSpec(), enable_kv_transfer=False)]
    )
    (only,) = groups_from_config(off)
    assert only.layer_names == ("a0",)


def test_expand_group_ids_keeps_the_null_block():
    assert expand_group_ids([0, 0, 5, 7], 2) == [0, 0, 0, 0, 10, 11, 14, 15]
    assert expand_group_ids([0, 3], 1) == [0, 3]


def test_failed_grouped_load_is_reported_by_request_not_by_block(caplog):
    """vLLM raises on block-level load failures of a model with several KV cache groups: a
    grouped load that fails (here: P released its export first) is reported finished and failed
    by request, with no block ids."""
    p = Side("P", "kv_producer", 1, "fa16")
    d = Side("D", "kv_consumer", 1, "fa32")
    try:
        _, _, dlists, hold, params = _hand_over(p, d, 75)
        assert hold
        p.step()  # exported
        assert p.workers[0].engine.abort_export("p-1")
        dreq = Request("d-1", list(range(75)), json.loads(json.dumps(params)))
        assert d.sched.get_num_new_matched_tokens(dreq, 0) == (75, True)
        d.sched.update_state_after_alloc(dreq, GroupBlocks(dlists), 75)
        got, end = {}, time.monotonic() + 15
        while not got and time.monotonic() < end:
            got = d.step()
            time.sleep(0.01)
        w = d.workers[0]
        assert got == {"d-1": 1}
        assert w.take_failed_loads() == {"d-1"}
        assert w.take_load_errors() == set()
    finally:
        p.close()
        d.close()
