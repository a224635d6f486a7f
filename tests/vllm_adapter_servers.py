"""Real kvxfer engines behind the vLLM connector's two sides, for the tier-1 tests (no vLLM):
a P server and a D server (one ``SchedulerSide`` and one ``WorkerSide`` per TP rank each) over
caches laid out as vLLM's kernels read them (FlashAttention-style token rows, or CPU_ATTN ISA
``vec`` pages), D's poisoned; seeded K/V written the way those kernels write them, a request
handed over P -> D step by step as vLLM drives it, and D's bytes checked exactly."""

from __future__ import annotations

import json
import time

import torch

from kvxfer.ports import free_port_base
from kvxfer.vllm.config import ConnectorConfig
from kvxfer.vllm.scheduler import SchedulerSide
from kvxfer.vllm.worker import WorkerSide

from .vllm_fakes import (
    Blocks,
    Request,
    Status,
    cpu_cache,
    cpu_vec_read,
    cpu_vec_write,
    fa_cache,
    fa_kernel_kv,
    token_rows,
    vllm_config,
)


def _fill_random(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(
        torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8)
    )


# ----------------------------------------------------------------------------- worker + scheduler, real engines

HEADS, HD, LAYERS = 4, 16, 3
POISON = -7.0  # every D block starts as this; blocks a load must not write keep it


def _fill_fa(caches, block_ids, num_tokens, seed):
    """Write seeded K/V rows for a request's tokens the way FlashAttention writes them;
    returns per layer [2, T, H, d]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in caches:
        k, v = fa_kernel_kv(t, HD)
        bs = k.shape[1]
        ids = torch.tensor(block_ids)[torch.arange(num_tokens) // bs]
        off = torch.arange(num_tokens) % bs
        rows = torch.randn(2, num_tokens, k.shape[2], HD, generator=g).to(t.dtype)
        k[ids, off] = rows[0]
        v[ids, off] = rows[1]
        out.append(rows)
    return out


def _fill_cpu(caches, block_ids, num_tokens, seed):
    """The same through ISA vec's page layout (K column-major); the slots after the last token
    of the last block hold other bytes (a whole-block move carries them, harmlessly)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in caches:
        _fill_random(t, seed + 100)
        rows = torch.randn(2, num_tokens, t.shape[1], HD, generator=g).to(t.dtype)
        cpu_vec_write(t, block_ids, rows[0], rows[1])
        out.append(rows)
    return out


_KINDS = {  # kind -> (cache factory, backend, isa, block size)
    "fa16": (lambda nb, h: fa_cache(nb, h, 16, HD, torch.bfloat16), "FLASH_ATTN", None, 16),
    "fa32": (lambda nb, h: fa_cache(nb, h, 32, HD, torch.bfloat16, "LBHNC"), "FLASH_ATTN", None, 32),
    "cpu32": (lambda nb, h: cpu_cache(nb, h, 32, HD, torch.bfloat16), "CPU_ATTN", "vec", 32),
}


class _Servers:
    """A P server and a D server (each: one SchedulerSide and one WorkerSide per TP rank) whose
    caches are of kinds ``p_kind`` / ``d_kind`` (see ``_KINDS``). D's caches start poisoned."""

    def __init__(
        self,
        tp_p: int,
        tp_d: int,
        p_kind="fa16",
        d_kind="fa32",
        lease_s=30.0,
        timeout_s=15.0,  # a bound, not a speed check: pairing a pg group on a loaded 2-core CI host took over 5 s
        nb=16,
        shm=False,
        workers_first=False,
        transport="auto",
    ):
        extra = {"lease_s": lease_s, "timeout_s": timeout_s, "transport": transport}
        self.kinds = (p_kind, d_kind)
        self.pc = ConnectorConfig.from_vllm(
            vllm_config(
                engine_id="P", tp=tp_p, port=free_port_base(tp_p), block_size=_KINDS[p_kind][3], extra=extra
            )
        )
        self.dc = ConnectorConfig.from_vllm(
            vllm_config(role="kv_consumer", engine_id="D", tp=tp_d, block_size=_KINDS[d_kind][3], extra=extra)
        )
        if not workers_first:  # workers_first: vLLM's order (the scheduler after the caches)
            self.ps, self.ds = SchedulerSide(self.pc), SchedulerSide(self.dc)
        self.pw, self.dw, self.pcache, self.dcache = [], [], [], []
        self.segments = []  # shm=True: every rank's caches in shared memory (ipc can map them)
        for tp, kind, cfg, workers, caches_out in (
            (tp_p, p_kind, self.pc, self.pw, self.pcache),
            (tp_d, d_kind, self.dc, self.dw, self.dcache),
        ):
            make, backend, isa, _ = _KINDS[kind]
            for r in range(tp):
                caches = {f"l{i}": make(nb, HEADS // tp) for i in range(LAYERS)}
                if shm:
                    caches = dict(zip(caches, self._in_shm(list(caches.values()))))
                if workers is self.dw:
                    for t in caches.values():
                        t.fill_(POISON)
                w = WorkerSide(cfg, r)
                w.register(
                    caches, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False, isa=isa
                )
                workers.append(w)
                caches_out.append(list(caches.values()))
        if workers_first:
            self.ps, self.ds = SchedulerSide(self.pc), SchedulerSide(self.dc)
        self.ps.set_handshake({r: w.handshake_info() for r, w in enumerate(self.pw)})
        self.ds.set_handshake({r: w.handshake_info() for r, w in enumerate(self.dw)})

    def _in_shm(self, tensors):
        """The same shapes and strides over one shared-memory segment (what the ipc transport
        maps on CPU), zeroed."""
        from kvxfer.transports.ipc.shm import alloc_shm_array

        per = -(-max(t.untyped_storage().nbytes() for t in tensors) // 256) * 256
        words, seg = alloc_shm_array(per * len(tensors) // 8, "kv")
        self.segments.append(seg)
        raw = words.view(torch.uint8)
        out = []
        for i, t in enumerate(tensors):
            base = raw[i * per : (i + 1) * per].view(t.dtype)
            out.append(base.as_strided(t.shape, t.stride(), base.storage_offset() + t.storage_offset()))
        return out

    def fill_p(self, block_ids, n, seed=5):
        fill = _fill_cpu if self.kinds[0] == "cpu32" else _fill_fa
        return [fill(c, block_ids, n, seed) for c in self.pcache]  # per P rank: per layer [2, T, H, d]

    def d_rows(self, r, layer, block_ids, n):
        """(K, V) [T, H, d] of D rank r's layer as D's attention kernel reads them."""
        t = self.dcache[r][layer]
        if self.kinds[1] == "cpu32":
            return cpu_vec_read(t, block_ids, n)
        k, v = fa_kernel_kv(t, HD)
        return token_rows(k, block_ids, n), token_rows(v, block_ids, n)

    def step(self, side: str) -> tuple[set[str], set[str], set[int]]:
        """One engine step of a server: meta to every worker, then aggregate like vLLM does
        (a request is done once every worker reported it)."""
        sched, workers = (self.ps, self.pw) if side == "P" else (self.ds, self.dw)
        meta = sched.build_connector_meta()
        counts_s, counts_r, bad = {}, {}, set()
        for w in workers:
            w.start(meta)
        for w in workers:
            s, r = w.finished()
            for rid in s:
                counts_s[rid] = counts_s.get(rid, 0) + 1
            for rid in r:
                counts_r[rid] = counts_r.get(rid, 0) + 1
            bad |= w.take_load_errors()
        return counts_s, counts_r, bad

    def close(self):
        from kvxfer.transports.ipc.shm import release_segment

        for w in self.pw + self.dw:
            w.close()
        for seg in self.segments:
            release_segment(seg)


def _run_until(srv, side, pred, timeout=30.0, first=None):
    """Step ``side`` until ``pred(acc)`` holds; acc accumulates per-request worker reports
    (``first``: the reports of a step already taken, counted first)."""
    acc = {"send": {}, "recv": {}, "bad": set()}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s, r, bad = first if first is not None else srv.step(side)
        first = None
        for k, v in s.items():
            acc["send"][k] = acc["send"].get(k, 0) + v
        for k, v in r.items():
            acc["recv"][k] = acc["recv"].get(k, 0) + v
        acc["bad"] |= bad
        if pred(acc):
            return acc
        time.sleep(0.01)
    raise AssertionError(f"timed out: {acc}")


def _hand_over(srv, n, p_blocks, d_blocks, hit=0, d_req="d-1", p_req="p-1", p_first=False):
    """P prefills ``n`` tokens into ``p_blocks``, D loads them into ``d_blocks`` after a local
    hit of ``hit`` tokens; returns P's rows (per rank, per layer) and D's worker reports.
    ``p_first``: P's workers export before D's start the load (else after)."""
    rows = srv.fill_p(p_blocks, n)
    toks = list(range(n))
    preq = Request(
        p_req, toks, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, num_computed_tokens=n
    )
    hold, params = srv.ps.request_finished(preq, p_blocks)
    assert hold
    dreq = Request(d_req, toks, json.loads(json.dumps(params)))  # through the proxy: JSON
    assert srv.ds.get_num_new_matched_tokens(dreq, hit) == (n - hit, True)
    srv.ds.update_state_after_alloc(dreq, Blocks(d_blocks), n - hit)
    first = None
    if p_first:
        srv.step("P")  # P's workers export
        first = srv.step("D")  # start_load_kv loads (one-sided: launched, and done by get_finished)
    else:
        srv.step("D")  # the load starts before the export exists (the params come from P's scheduler)
        srv.step("P")  # now P exports
    acc = _run_until(srv, "D", lambda a: a["recv"].get(d_req) == len(srv.dw), first=first)
    srv.ds.update_connector_output({d_req})
    return rows, acc


def _check_d(srv, rows, d_blocks, n, hit=0, written=()):
    """D's kernels read exactly P's K/V for tokens [hit, n); blocks of the hit stay poisoned, and
    every block but these and ``written`` (an earlier request's)."""
    tp_p, tp_d = len(srv.pw), len(srv.dw)
    want = [torch.cat([rows[r][layer] for r in range(tp_p)], dim=2) for layer in range(LAYERS)]
    hd = HEADS // tp_d
    bs_d = _KINDS[srv.kinds[1]][3]
    for r in range(tp_d):
        for layer in range(LAYERS):
            got_k, got_v = srv.d_rows(r, layer, d_blocks, n)
            w = want[layer][:, :, r * hd : (r + 1) * hd]
            assert torch.equal(got_k[hit:].view(torch.int16), w[0, hit:].view(torch.int16)), (r, layer)
            assert torch.equal(got_v[hit:].view(torch.int16), w[1, hit:].view(torch.int16)), (r, layer)
            t = srv.dcache[r][layer]
            for blk in d_blocks[: hit // bs_d]:
                assert bool((t[blk] == POISON).all()), f"block {blk} of the local hit was written"
            others = [b for b in range(t.shape[0]) if b not in d_blocks and b not in written]
            assert bool((t[others] == POISON).all()), "a block outside the request was written"
