"""An ops call with many block ids does not wait for the device work queued ahead of it.

The ids travel to the device with the call. From pageable host memory the driver may wait for
the stream before such a copy: on an H200 (``profiling/bench_batching.py``, 2026-11-26) the
Triton backend's call with 27750 ids took 20.6 ms of host time, the length of the work queued
ahead, where 3552 ids took 0.5 ms. Each test queues a long spin, makes the call, and checks the
spin is still running when the call returns; then it checks the bytes.
"""

from __future__ import annotations

import pytest
import torch

from kvxfer import ops
from kvxfer.backends import registry
from kvxfer.spec import KVCacheSpec, Layout

pytestmark = pytest.mark.gpu

NUM_TOKENS = 30000  # ids of block size 1: 120-240 KB of ids per side, well over 64 KB
SPIN_CYCLES = 4_000_000_000  # ~2 s at 2 GHz: far longer than any host work of one call
POISON = -7


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def _caches(spec: KVCacheSpec, num_blocks: int, dev: torch.device, fill: bool) -> list[torch.Tensor]:
    """Every element of layer ``l``'s token slot ``b`` holds ``(l * 100000 + b) % 32749`` as
    int16 bits (the payload names its layer and slot), or the poison when not ``fill``."""
    out = []
    for layer in range(spec.num_layers):
        c = torch.full(spec.cache_shape(num_blocks, 1), POISON, dtype=torch.int16, device=dev)
        if fill:
            slot = torch.arange(num_blocks, device=dev, dtype=torch.int32)
            val = ((layer * 100000 + slot) % 32749).to(torch.int16)
            c.copy_(val.view(1, num_blocks, 1, 1, 1).expand_as(c))
        out.append(c.view(torch.bfloat16))
    return out


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_copy_with_many_ids_does_not_wait_for_queued_work(dev, backend):
    status = registry.backend_status(dev)[backend]
    if not status["available"]:
        pytest.skip(f"the {backend} backend is unavailable here: {status['reason']}")
    spec = KVCacheSpec(2, 2, 64, 1, torch.bfloat16, Layout.NHD)
    num_blocks = NUM_TOKENS + 5
    src = _caches(spec, num_blocks, dev, fill=True)
    dst = _caches(spec, num_blocks, dev, fill=False)
    src_ids = list(range(NUM_TOKENS))[::-1]
    dst_ids = list(range(5, NUM_TOKENS + 5))

    def call():
        ops.copy_blocks(src, spec, src_ids, dst, spec, dst_ids, NUM_TOKENS, backend=backend)

    call()  # warm: compile, load, size the grid, fill the host caches
    torch.cuda.synchronize(dev)
    for c in dst:
        c.view(torch.int16).fill_(POISON)
    torch.cuda._sleep(SPIN_CYCLES)
    spun = torch.cuda.Event()
    spun.record()
    call()
    still_spinning = not spun.query()
    torch.cuda.synchronize(dev)
    assert still_spinning, f"{backend}: the call with {NUM_TOKENS} ids waited for the queued spin"
    for s, d in zip(src, dst):
        s16, d16 = s.view(torch.int16), d.view(torch.int16)
        assert torch.equal(d16[:, 5:], s16[:, :NUM_TOKENS].flip(1))
        assert bool((d16[:, :5] == POISON).all()), "slots outside the request were written"
