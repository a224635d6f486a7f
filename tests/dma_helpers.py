"""Helpers of the copy-engine tests (``tests/test_dma.py``, ``tests/test_dma_driver.py``): a fake
``cuMemcpyBatchAsync`` on CPU memory, built from the very ctypes prototype the real symbol gets;
the autouse fixture under which the rule applies ($KVXFER_DMA=rule: a test module imports it);
specs, and caches of random or poisoned bytes."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvxfer import KVCacheSpec, Layout
from kvxfer.backends import batch_copy, dma

POISON = 0xA5


class FakeDriver:
    """``cuMemcpyBatchAsync`` on CPU memory: a ctypes callback of ``batch_copy.PROTOTYPES[abi]`` that
    records each batch (runs, attributes, stream) and moves the bytes with ``memmove``; ``rc``
    makes it fail (and, in the 12.8 form, report run ``fail_at``)."""

    def __init__(self, abi: int = 2, rc: int = 0, fail_at: int = 0) -> None:
        self.abi, self.rc, self.fail_at = abi, rc, fail_at
        self.calls: list[dict] = []
        self.fn = batch_copy.PROTOTYPES[abi](self._call)
        self.copier = batch_copy.BatchCopier(self.fn, abi, f"fake v{abi}", ("cpu",))

    def _call(self, dsts, srcs, sizes, count, attrs, idxs, num_attrs, *rest):
        stream = rest[-1]
        a = attrs[0]
        self.calls.append(
            {
                "runs": [(dsts[i], srcs[i], sizes[i]) for i in range(count)],
                "attrs": [
                    (
                        attrs[k].srcAccessOrder,
                        (attrs[k].srcLocHint.type, attrs[k].srcLocHint.id),
                        (attrs[k].dstLocHint.type, attrs[k].dstLocHint.id),
                        attrs[k].flags,
                    )
                    for k in range(num_attrs)
                ],
                "idxs": [idxs[k] for k in range(num_attrs)],
                "stream": stream,
                "flags": a.flags,
            }
        )
        if self.rc:
            if self.abi == 1:
                rest[0][0] = self.fail_at
            return self.rc
        for i in range(count):
            ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return 0


@pytest.fixture(autouse=True)
def _rule_on(monkeypatch):
    """The rule applies in these tests ($KVXFER_DMA=rule; by default a call takes a kernel:
    test_the_copy_engines_are_not_taken_by_default)."""
    monkeypatch.setenv(dma.DMA_ENV, "rule")


def _spec(layout="NHD", heads=4, dim=16, bs=4, layers=3, dtype=torch.bfloat16) -> KVCacheSpec:
    mla = layout == "MLA"
    return KVCacheSpec(
        layers, 1 if mla else heads, dim, bs, dtype, Layout.NHD if mla else Layout(layout), use_mla=mla
    )


def _caches(spec: KVCacheSpec, nb: int, fill: str, seed: int = 0, heads: int | None = None):
    heads = spec.num_kv_heads if heads is None else heads
    shape = spec.local_cache_shape(nb, heads)
    out = []
    g = torch.Generator().manual_seed(seed)
    for _ in range(spec.num_layers):
        c = torch.empty(shape, dtype=spec.dtype)
        b = c.view(torch.uint8)
        if fill == "poison":
            b.fill_(POISON)
        else:
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
        out.append(c)
    return out


def _bytes(ts) -> torch.Tensor:
    return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in ts])
