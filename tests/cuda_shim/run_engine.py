"""The engine's transfers with every CPU op launched through the CUDA C++ kernels (host shim).

Usage: python run_engine.py LIB.so   (under LD_PRELOAD=libasan.so for the sanitized build)

The ``cpu`` and ``torch`` backends of :mod:`kvxfer.ops` are replaced by :class:`HostKernels`:
each gather, scatter and copy the engine makes builds the very launch the CUDA backend would
(``plan_*``: entry, grid, arguments, block and layer tables) and runs it on CPU tensors, so
AddressSanitizer checks every address a launch of the GPU path computes (cache and staging
memory is allocated with malloc here, which ASan guards). The scenarios mirror the GPU tests:
P and D engines in one process over ``pg`` (whole wire, and the staged pipeline in chunks),
over ``ipc``, and with layouts, block sizes and a partial load that take offset views.
Payloads are written and checked with the torch reference backend, not the kernels under
test. One JSON line per scenario on stdout: ``{"id", "ok", "error", "launches"}``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import types
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from host_kernels import HostKernels  # noqa: E402

from kvxfer import KVCacheSpec, Layout, TransferEngine, ops  # noqa: E402
from kvxfer.transports.pg.pipeline import StagedPipeline  # noqa: E402
from tests.engine_payload import POISON, payload  # noqa: E402

DEADLINE_S = 60.0


def _install(kernels: HostKernels) -> None:
    mod = types.ModuleType("kvxfer_shim_backend")
    mod.is_available = lambda device: torch.device(device).type == "cpu"
    mod.gather, mod.scatter, mod.copy = kernels.gather, kernels.scatter, kernels.copy
    sys.modules[mod.__name__] = mod
    for name in ("cpu", "torch"):
        ops._MODULES[name] = mod.__name__
    ops.reset_backends()


def _reference() -> None:
    """The torch reference module back under its own name, for the oracle's calls."""
    ops._MODULES["torch"] = "kvxfer.backends.torch_ref"
    ops.reset_backends()


def _caches(spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
    caches = [torch.empty(spec.cache_shape(num_blocks, 1), dtype=spec.dtype) for _ in range(spec.num_layers)]
    for c in caches:
        c.view(torch.uint8).fill_(POISON)
    return caches


def _scenario(kernels: HostKernels, transport: str, src: KVCacheSpec, dst: KVCacheSpec, staged_tokens: int | None,
              num_tokens: int, computed: int) -> None:  # fmt: skip
    """P exports ``num_tokens`` of payload, D loads it (holding ``computed`` tokens already);
    raises AssertionError naming what differs."""
    sb, db = src.num_blocks_for(num_tokens), dst.num_blocks_for(num_tokens)
    sc, dc = _caches(src, sb + 8), _caches(dst, db + 8)
    s_ids, d_ids = list(range(3, 3 + sb))[::-1], list(range(5, 5 + db))
    want = payload(src, 7, num_tokens, list(range(src.num_kv_heads)))
    _reference()
    ops.scatter_blocks(want, sc, src, s_ids, num_tokens, backend="torch")
    _install(kernels)
    n0 = len(kernels.launches)

    def pipe():
        return (
            None
            if staged_tokens is None
            else StagedPipeline(buffer_bytes=staged_tokens * src.bytes_per_token())
        )

    kw = {} if transport == "ipc" else {"pipeline": pipe()}
    if transport == "ipc":  # ipc maps the exporter's cache: shared memory
        from kvxfer.transports.ipc.shm import alloc_shm_caches

        shm = alloc_shm_caches(src, sb + 8, 1)
        for a, b in zip(shm.caches, sc):
            a.copy_(b)
        sc = shm.caches
    p = TransferEngine(src, sc, 0, 1, "P", transport=transport, **kw).start()
    d = TransferEngine(dst, dc, 0, 1, "D", transport=transport, **kw).start()
    try:
        d.load("x", p.export("x", s_ids, num_tokens), d_ids, num_computed_tokens=computed)
        end, done = time.monotonic() + DEADLINE_S, False
        while not done and time.monotonic() < end:
            r = d.poll()
            assert not r.failed, r.errors
            done = "x" in r.finished_recving
            time.sleep(0.002)
        assert done, "the load did not finish"
    finally:
        d.close()
        p.close()
        if transport == "ipc":
            shm.close()
    assert len(kernels.launches) > n0, "no launch went through the shim"
    _reference()
    got = ops.gather_blocks(dc, dst, d_ids, num_tokens, backend="torch")
    skip = computed  # tokens D held already: not written, still poison
    assert torch.equal(got[..., skip:, :].view(torch.uint8), want[..., skip:, :].view(torch.uint8)), (
        "bytes differ"
    )
    assert bool((got[..., :skip, :].view(torch.uint8) == POISON).all()), "a held prefix token was written"
    used = set(d_ids)
    for c in dc:
        free = [b for b in range(c.shape[1]) if b not in used]
        assert bool((c[:, free].view(torch.uint8) == POISON).all()), "a block outside the load was written"


def scenarios() -> list[tuple[str, dict]]:
    out = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "e4m3")):
        one = KVCacheSpec(2, 4, 64, 16, dtype)  # the one-GPU pg test's caches
        out += [
            (
                f"pg-staged-{name}",
                dict(transport="pg", src=one, dst=one, staged_tokens=32, num_tokens=90, computed=0),
            ),
            (
                f"pg-whole-{name}",
                dict(transport="pg", src=one, dst=one, staged_tokens=None, num_tokens=90, computed=0),
            ),
        ]
    a = KVCacheSpec(3, 4, 32, 16, torch.bfloat16, Layout.NHD)
    b = KVCacheSpec(3, 4, 32, 32, torch.bfloat16, Layout.HND)
    out += [
        ("pg-staged-nhd16-hnd32-partial", dict(transport="pg", src=a, dst=b, staged_tokens=32, num_tokens=150, computed=64)),
        ("pg-staged-hnd32-nhd16", dict(transport="pg", src=b, dst=a, staged_tokens=40, num_tokens=77, computed=0)),
        ("ipc-nhd16-hnd32-partial", dict(transport="ipc", src=a, dst=b, staged_tokens=None, num_tokens=150, computed=32)),
    ]  # fmt: skip
    return out


def main() -> int:
    kernels = HostKernels(sys.argv[1], max_blocks=3)
    for sid, kw in scenarios():
        n0 = len(kernels.launches)
        try:
            _scenario(kernels, **kw)
            ok, err = True, None
        except Exception as e:  # reported per scenario; ASan aborts the process on a bad address
            ok, err = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        launches = sorted({x.name for x in kernels.launches[n0:]})
        print(json.dumps({"id": sid, "ok": ok, "error": err, "launches": launches}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
