"""Tier 1: P -> D through the vLLM connector's scheduler and worker sides with real engines, for a
model of a Mamba2 state group and a full-attention group laid out as vLLM 0.32's hybrid
allocator does (docs/research/vllm-hybrid.md §1.4, §3.3): layer ``j`` of both groups share one
CPU_ATTN tensor (region), a state layer's page ``b`` is the region's block ``b`` (conv, then
SSM, then padding), vLLM hands the connector its int8 ``[B, 1, 1, content]`` view.

P truncates the prompt (N−1 flow), its blocks hold random bytes; D's are poison. After the load,
D's attention blocks for the N−1 tokens and its state block equal P's byte for byte, whole pages,
and every other block of D is still poison (the null block and D's spare blocks included).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from kvxfer.ports import free_port_base
from kvxfer.vllm.config import ConnectorConfig
from kvxfer.vllm.groups import groups_from_config
from kvxfer.vllm.scheduler import SchedulerSide
from kvxfer.vllm.worker import WorkerSide

from .test_vllm_state import BLOCK, Blocks, Config, FullAttentionSpec, Group, VllmRequest, granite
from .vllm_fakes import Status, cpu_cache, vllm_config

HEADS, HD, NB = 4, 32, 12
POISON = -7  # int8


def _groups(tp: int):
    page = HEADS // tp * BLOCK * 2 * HD * 4
    cfg = Config(
        [Group(["m0", "m1"], granite(tp, page_size_padded=page)), Group(["a0", "a1"], FullAttentionSpec())]
    )
    return groups_from_config(cfg, "granite", tp_size=tp, hf_config=SimpleNamespace(mamba_n_groups=1))


class Side:
    def __init__(self, eid: str, role: str, tp: int):
        self.tp = tp
        port = free_port_base(tp) if role != "kv_consumer" else 15000
        self.cfg = ConnectorConfig.from_vllm(
            vllm_config(
                role=role, engine_id=eid, tp=tp, port=port, block_size=BLOCK, extra={"timeout_s": 5.0}
            )
        )
        groups = _groups(tp)
        content = groups[0].state.content_bytes
        self.workers, self.regions = [], []
        g = torch.Generator().manual_seed(5)
        for r in range(tp):
            regions = [cpu_cache(NB, HEADS // tp, BLOCK, HD, torch.float32) for _ in range(2)]
            for t in regions:
                raw = t.view(torch.int8)
                if role == "kv_consumer":
                    raw.fill_(POISON)
                else:
                    raw.copy_(torch.randint(-128, 128, raw.shape, generator=g, dtype=torch.int8))
            page = regions[0].stride(0) * 4
            states = [t.view(torch.int8).view(NB, page)[:, None, None, :content] for t in regions]
            caches = {"m0": states[0], "m1": states[1], "a0": regions[0], "a1": regions[1]}
            w = WorkerSide(self.cfg, r, groups=groups)
            w.register(
                caches, backend="CPU_ATTN", head_size=HD, total_kv_heads=HEADS, use_mla=False, isa="vec"
            )
            self.workers.append(w)
            self.regions.append(regions)
        self.sched = SchedulerSide(self.cfg, groups=groups)
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


def _until(side: Side, rid: str, end: float) -> None:
    got = 0
    while got < side.tp and time.monotonic() < end:
        got += side.step().get(rid, 0)
        time.sleep(0.01)
    assert got == side.tp, (rid, got)


@pytest.mark.parametrize(("tp", "n"), [(1, 2), (1, 33), (1, 70), (2, 97), (1, 64)])
def test_state_and_attention_p_to_d_exact(tp, n):
    p, d = Side("P", "kv_producer", tp), Side("D", "kv_consumer", tp)
    try:
        prompt = list(range(3, 3 + n))
        preq = VllmRequest("p-1", prompt, {"do_remote_decode": True}, max_tokens=1)
        p.sched.on_new_request(preq)
        preq.status, preq.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, n - 1
        need = -(-(n - 1) // BLOCK)
        pstate, pattn = 9, list(range(1, 1 + need))
        hold, params = p.sched.request_finished(preq, ([pstate], pattn))
        assert hold and params["groups"] == [1, need]
        dreq = VllmRequest("d-1", prompt, json.loads(json.dumps(params)))
        assert d.sched.get_num_new_matched_tokens(dreq, 0) == (n - 1, True)
        dstate, dattn = 2, list(range(5, 5 + -(-n // BLOCK)))
        d.sched.update_state_after_alloc(dreq, Blocks([[dstate], dattn]), n - 1)
        d.step()
        p.step()
        end = time.monotonic() + 20
        _until(d, "d-1", end)
        assert not any(w.take_failed_loads() for w in d.workers)
        for r in range(tp):
            for j in range(2):
                pr, dr = p.regions[r][j].view(torch.int8), d.regions[r][j].view(torch.int8)
                pairs = [(dstate, pstate), *zip(dattn[:need], pattn)]
                for db, pb in pairs:
                    assert torch.equal(dr[db], pr[pb]), (r, j, db, pb)
                written = {db for db, _ in pairs}
                rest = [b for b in range(NB) if b not in written]
                assert 0 in rest and bool((dr[rest] == POISON).all()), f"rank {r} region {j}: a stray write"
        _until(p, "p-1", end)
        assert all(w.engine.stats()["blocks_held"] == 0 for w in p.workers)
    finally:
        p.close()
        d.close()
