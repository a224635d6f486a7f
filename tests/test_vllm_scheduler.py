"""Tier 2: vLLM's own ``Scheduler`` drives ``KvxferConnector`` (its scheduler role); the workers
are the connector's ``WorkerSide`` with real kvxfer engines over caches in CPU_ATTN layout.

Skipped, saying so, when vLLM is not importable (not part of CI). Run it in an environment
made by ``bash scripts/vllm_env.sh 0.32`` (or ``0.33``)::

    .venv-vllm0.32/bin/python -m pytest -q tests/test_vllm_scheduler.py
"""

from __future__ import annotations

import importlib.util
import tempfile
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (tier 2 runs in the environment of scripts/vllm_env.sh)",
)

BS, HEADS, HD, LAYERS, NB = 16, 4, 16, 2, 64


def _vllm_config(model_dir: str, role: str, engine_id: str, port: int, tp: int = 1, extra=None):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=512, dtype="float32")
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=512, is_encoder_decoder=False
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer.vllm",
            kv_role=role,
            engine_id=engine_id,
            kv_port=port,
            kv_connector_extra_config={"host": "127.0.0.1", **(extra or {})},
        ),
    )


class _Server:
    """One vLLM scheduler with KvxferConnector, and ``tp`` WorkerSides standing in for its workers."""

    def __init__(self, model_dir, role, engine_id, tp=1, extra=None):
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from kvxfer.ports import free_port_base
        from kvxfer.vllm.config import ConnectorConfig
        from kvxfer.vllm.worker import WorkerSide

        self.cfg = _vllm_config(model_dir, role, engine_id, free_port_base(tp), tp, extra)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS // tp, head_size=HD, dtype=torch.float32)
        kvc = KVCacheConfig(
            num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)]
        )
        self.cfg.cache_config.num_gpu_blocks = NB
        self.sched = Scheduler(
            vllm_config=self.cfg,
            kv_cache_config=kvc,
            structured_output_manager=StructuredOutputManager(self.cfg),
            block_size=BS,
            log_stats=True,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(self.cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BS, hash_fn)
        cc = ConnectorConfig.from_vllm(self.cfg)
        self.workers, self.caches = [], []
        for r in range(tp):
            caches = {f"l{i}": torch.zeros(NB, HEADS // tp, BS, 2 * HD) for i in range(LAYERS)}
            w = WorkerSide(cc, r)
            w.register(
                caches, backend="CPU_ATTN", head_size=HD, total_kv_heads=HEADS, use_mla=False, isa="vec16"
            )
            self.workers.append(w)
            self.caches.append(caches)
        from kvxfer.vllm.connector import KvxferHandshakeMetadata

        self.sched.connector.set_xfer_handshake_metadata(
            {r: KvxferHandshakeMetadata(**w.handshake_info()) for r, w in enumerate(self.workers)}
        )

    def add(self, rid, prompt, max_tokens, params):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params})
        req = Request(rid, list(prompt), sp, None, block_hasher=self.hasher)
        self.sched.add_request(req)
        return req

    def step(self, token: int = 5):
        """schedule -> workers (meta, poll) -> aggregated output -> update_from_output."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        sending, recving, bad = {}, {}, set()
        for w in self.workers:
            w.start(meta.as_meta())
        for w in self.workers:
            s, r = w.finished()
            for rid in s:
                sending[rid] = sending.get(rid, 0) + 1
            for rid in r:
                recving[rid] = recving.get(rid, 0) + 1
            bad |= w.take_load_errors()
        self._acc_s = (
            {k: self._acc_s.get(k, 0) + v for k, v in sending.items()} if hasattr(self, "_acc_s") else sending
        )
        self._acc_r = (
            {k: self._acc_r.get(k, 0) + v for k, v in recving.items()} if hasattr(self, "_acc_r") else recving
        )
        tp = len(self.workers)
        done_s = {k for k, v in self._acc_s.items() if v == tp}
        done_r = {k for k, v in self._acc_r.items() if v == tp}
        for k in done_s:
            del self._acc_s[k]
        for k in done_r:
            del self._acc_r[k]
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[token] for _ in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=done_s or None, finished_recving=done_r or None, invalid_block_ids=bad
            ),
        )
        return so, self.sched.update_from_output(so, out)

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self):
        for w in self.workers:
            w.close()


@pytest.fixture(scope="module")
def model_dir():
    from .vllm_models import write_model

    with tempfile.TemporaryDirectory() as d:
        yield write_model(d, num_key_value_heads=HEADS, head_dim=HD, num_attention_heads=4, hidden_size=64)


def _outputs(eco) -> dict:
    """request id -> EngineCoreOutput of one update_from_output result."""
    return {o.request_id: o for outs in eco.values() for o in outs.outputs}


def _prefill(p, rid, prompt, max_steps=20):
    p.add(rid, prompt, 1, {"do_remote_decode": True})
    for _ in range(max_steps):
        _, eco = p.step()
        o = _outputs(eco).get(rid)
        if o is not None and o.finished:
            return o.kv_transfer_params
    raise AssertionError("prefill did not finish")


def _until(server, pred, timeout=30.0):  # generous: 2 shared cores, 6+ engines in one process
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        so, eco = server.step()
        if pred(so, eco):
            return so, eco
        time.sleep(0.01)
    raise AssertionError("timed out")


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 1), (4, 2)])
@pytest.mark.parametrize("prompt_len", [10, 70])  # shorter than a block; several blocks
def test_remote_prefill_then_decode_lifecycle(model_dir, tp_p, tp_d, prompt_len):
    p = _Server(model_dir, "kv_producer", "P", tp_p)
    d = _Server(model_dir, "kv_consumer", "D", tp_d)
    try:
        free_p = p.free_blocks()
        prompt = list(range(3, 3 + prompt_len))
        params = _prefill(p, "p1", prompt)
        assert params["do_remote_prefill"] and params["num_valid_tokens"] == prompt_len
        assert params["num_tokens"] == -(-prompt_len // BS) * BS  # CPU_ATTN pages: whole blocks
        assert p.free_blocks() == free_p - -(-prompt_len // BS)  # held until finished_sending
        d.add("d1", prompt, 3, params)
        so, _ = d.step()  # allocates, queues the load; P's workers export on P's next step
        assert "d1" not in so.num_scheduled_tokens
        p.step()
        _until(d, lambda so, eco: "d1" in so.num_scheduled_tokens)  # loaded, now decoding
        _until(p, lambda so, eco: p.free_blocks() == free_p)  # every D rank notified: P freed
        assert not p.sched.requests and p.sched.connector.scheduler_side.num_tracked() == 0
        _until(d, lambda so, eco: not d.sched.requests)
        assert d.sched.connector.scheduler_side.num_tracked() == 0
        assert all(w.pending() == 0 for w in p.workers + d.workers)
    finally:
        p.close()
        d.close()


def test_abort_before_load_releases_p_early(model_dir):
    p = _Server(model_dir, "kv_producer", "P", 2, extra={"lease_s": 60})
    d = _Server(model_dir, "kv_consumer", "D", 1)
    try:
        free_p = p.free_blocks()
        params = _prefill(p, "p1", list(range(40)))
        p.step()  # exported
        d.add("d1", list(range(40)), 3, params)
        from vllm.v1.request import RequestStatus

        d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)  # before it was scheduled
        d.step()  # the release goes out
        t0 = time.monotonic()
        _until(p, lambda so, eco: p.free_blocks() == free_p, timeout=10)
        assert time.monotonic() - t0 < 10 < 60
    finally:
        p.close()
        d.close()


def test_abort_during_transfer_frees_both_sides(model_dir):
    p = _Server(model_dir, "kv_producer", "P", 1)
    d = _Server(model_dir, "kv_consumer", "D", 1)
    try:
        free_p, free_d = p.free_blocks(), d.free_blocks()
        params = _prefill(p, "p1", list(range(50)))
        d.add("d1", list(range(50)), 3, params)
        d.step()  # WAITING_FOR_REMOTE_KVS, load queued
        from vllm.v1.request import RequestStatus

        d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        p.step()
        _until(d, lambda so, eco: d.free_blocks() == free_d)  # freed once the load reported
        _until(p, lambda so, eco: p.free_blocks() == free_p)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_transfer_failure_reported_as_failed_blocks(model_dir, policy, caplog):
    p = _Server(model_dir, "kv_producer", "P", 1)
    d = _Server(model_dir, "kv_consumer", "D", 1, extra={"timeout_s": 0.5})
    d.sched.recompute_kv_load_failures = policy == "recompute"  # vLLM's kv_load_failure_policy
    try:
        params = _prefill(p, "p1", list(range(40)))
        p.close()  # P goes away before it exported: handshake/transfer fails
        d.add("d1", list(range(40)), 2, params)
        with caplog.at_level("WARNING", logger="kvxfer"):
            d.step()
            if policy == "recompute":
                so, _ = _until(d, lambda so, eco: so.num_scheduled_tokens.get("d1", 0) > 1, timeout=15)
                assert so.num_scheduled_tokens["d1"] == 40  # recomputed from scratch after the failed load
            _until(d, lambda so, eco: not d.sched.requests, timeout=20)  # finished (or failed)
            # what vLLM's API server sends after the error: the params again, as a pre-aborted
            # request with a placeholder prompt (notify_kv_transfer_request_rejected)
            from vllm.v1.request import RequestStatus

            d.add("notice", [0], 1, params)
            d.sched.finish_requests("notice", RequestStatus.FINISHED_ABORTED)
            d.step()
        warned = [r.getMessage() for r in caplog.records if r.name.startswith("kvxfer")]
        assert any("load of d1 failed" in m for m in warned), warned
        assert len(warned) == 1, warned  # the load's failure, and no second, false warning
        assert d.sched.connector.scheduler_side.num_tracked() == 0
    finally:
        d.close()


def test_prefix_hit_on_d_loads_the_rest_with_full_params(model_dir):
    """D already holds the first two blocks (an earlier request's): the second request's load
    carries P's params unmodified, D's block ids for the whole request and the hit as
    num_computed_tokens; the rest arrives exactly (CPU_ATTN pages, whole blocks) and the hit's
    blocks are not written."""
    p = _Server(model_dir, "kv_producer", "P", 1)
    d = _Server(model_dir, "kv_consumer", "D", 1)
    try:
        g = torch.Generator().manual_seed(3)
        for t in p.caches[0].values():
            t.copy_(torch.randn(t.shape, generator=g))
        a = list(range(3, 43))  # 40 tokens: blocks of 16, 16, 8
        b = a[:32] + list(range(100, 120))  # shares two blocks with a
        pa = _prefill(p, "pa", a)
        pb = _prefill(p, "pb", b)
        d.add("da", a, 2, pa)
        _until(d, lambda so, eco: not d.sched.requests)
        for t in d.caches[0].values():
            t.fill_(-7.0)  # poison: the blocks of D's hit must stay so
        d.add("db", b, 2, pb)
        loads = []
        orig = d.workers[0].start

        def spy(meta):
            loads.extend(meta.loads)
            return orig(meta)

        d.workers[0].start = spy
        p.step()
        _until(d, lambda so, eco: "db" in so.num_scheduled_tokens)
        (ld,) = [x for x in loads if x.request_id == "db"]
        assert ld.params == pb and ld.num_computed_tokens == 32 and len(ld.block_ids) == 4
        mgr = d.sched.kv_cache_manager
        d_ids = mgr.get_block_ids("db")[0]
        p_ids = pb["block_ids"]
        for name, pt in p.caches[0].items():
            dt = d.caches[0][name]
            assert bool((dt[d_ids[:2]] == -7.0).all()), name  # the hit: not written
            for pi, di in zip(p_ids[2:], d_ids[2:4]):
                assert torch.equal(dt[di], pt[pi]), (name, pi, di)  # the rest: whole pages
        _until(d, lambda so, eco: not d.sched.requests)
        _until(p, lambda so, eco: not p.sched.requests)
    finally:
        p.close()
        d.close()


def test_lease_expiry_frees_p(model_dir):
    p = _Server(model_dir, "kv_producer", "P", 1, extra={"lease_s": 0.5})
    try:
        free_p = p.free_blocks()
        _prefill(p, "p1", list(range(30)))
        _until(p, lambda so, eco: p.free_blocks() == free_p, timeout=10)
    finally:
        p.close()


def test_get_finished_count_is_world_size(model_dir):
    from kvxfer.vllm.connector import KvxferConnector

    assert KvxferConnector.get_finished_count(object.__new__(KvxferConnector)) is None


def test_connector_api_points_and_hybrid_models(model_dir):
    """requires_kv_delivery where the server exports; handle_preemptions is a no-op; a model
    with full-attention and sliding-window groups is carried (each group registered), so is a
    Mamba2 state group, with prefix caching off ("none") or on ("align": a positional list)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvxfer.vllm.connector import KvxferConnector, KvxferConnectorMetadata

    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32)
    one = KVCacheConfig(
        num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], full)]
    )
    for role, delivers in (("kv_producer", True), ("kv_both", True), ("kv_consumer", False)):
        c = KvxferConnector(_vllm_config(model_dir, role, "E", 15000), KVConnectorRole.SCHEDULER, one)
        assert c.requires_kv_delivery is delivers
        assert c.handle_preemptions(KvxferConnectorMetadata()) is None
        assert supports_hma(c) and c.groups is None
    swa = SlidingWindowSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32, sliding_window=64
    )
    two = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], swa)],
    )
    c = KvxferConnector(_vllm_config(model_dir, "kv_consumer", "E", 15000), KVConnectorRole.SCHEDULER, two)
    assert [(g.window, g.layer_names) for g in c.groups] == [(None, ("l0",)), (64, ("l1",))]
    # vLLM's own MambaSpec (Mamba2: x of 4 heads x 16, one group of d_state 16): carried in both
    # cache modes; in prefix caching's "align" mode its list is positional
    shapes = ((3, 4 * 16 + 2 * 16), (4, 16, 16))
    for mode in ("none", "align"):
        mamba = MambaSpec(
            block_size=BS, shapes=shapes, dtypes=(torch.float32, torch.float32), mamba_cache_mode=mode
        )
        hybrid = KVCacheConfig(
            num_blocks=NB,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["m0"], mamba), KVCacheGroupSpec(["l1"], full)],
        )
        cfg = _vllm_config(model_dir, "kv_consumer", "E", 15000)
        c = KvxferConnector(cfg, KVConnectorRole.SCHEDULER, hybrid)
        assert [g.describe() for g in c.groups] == ["mamba2 x1", "full x1"]
        assert c.groups[0].positional is (mode == "align")


def test_what_vllm_does_with_hybrid_models_for_this_connector():
    """What docs/INTEGRATION.md says happens: the connector declares SupportsHMA, so vLLM keeps
    its hybrid KV cache manager on (per-group block lists). Without a connector's HMA support it
    would promote a mixed model's sliding-window layers to full attention (one group), while a
    uniform sliding-window model keeps its SlidingWindowSpec (one group: P's null blocks)."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kvc = KVTransferConfig(
        kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.vllm", kv_role="kv_both"
    )
    assert KVConnectorFactory.supports_hma_config(kvc) is True
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=32
    )
    mixed = {"l0": full, "l1": swa}
    unify_hybrid_kv_cache_specs(mixed)
    assert {type(s).__name__ for s in mixed.values()} == {"FullAttentionSpec"}
    uniform = {"l0": swa, "l1": swa}
    unify_hybrid_kv_cache_specs(uniform)
    assert {type(s).__name__ for s in uniform.values()} == {"SlidingWindowSpec"}
