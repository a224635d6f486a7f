"""A hybrid request with a Gated DeltaNet state: time per request, whole pages against
re-sharded ones, per transport.

A Qwen3-Next-like model per rank (its per-layer shapes: GDN with 16 key heads and 32 value
heads of 128, conv kernel 4, bf16 state; full attention with 2 kv heads of 256, bf16), with
``--gdn-layers`` GDN layers and one full-attention layer, laid out as vLLM's hybrid allocator
lays it out: one page per block, the attention block raised until it holds a layer's state
(``--block`` tokens; the state is ~1.06 MB a layer at TP 1). Two engines or three (D at TP 2)
in one process (threads), plain CPU caches (``ipc`` reads them with cross-memory attach).

Cases: P TP 1 -> D TP 1 laid out alike (the state page moves whole), and P TP 1 -> D TP 2 with
the conv state in the other layout (DS; each D rank copies its half of every head out of P's
page: re-sharded). Per case and transport: the median time from ``load()`` to every D rank
reporting the load finished, over ``--iters`` requests of ``--tokens`` tokens, and the bytes
D's ranks moved (``stats()["bytes"]``), against the limit measured in the same run: a
one-thread ``copy_`` of that many contiguous bytes (``x copy_``: its time over the request's).

    python profiling/bench_state.py [--gdn-layers 12] [--tokens 2048] [--iters 5] [--transports ipc,pg]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvxfer import AttentionGroup, KVCacheSpec, StateGroup, StateSpec, TransferEngine
from kvxfer.ports import free_port_base

KV_HEADS, HEAD_DIM = 2, 256


def _state(layers: int, tp: int, page: int, conv_layout: str) -> StateSpec:
    return StateSpec.gdn(layers, 16, 32, 128, 128, 4, torch.bfloat16, tp_size=tp, conv_layout=conv_layout,
                         page_size_bytes=page)  # fmt: skip


def _caches(spec: KVCacheSpec, tp: int, nb: int) -> list[torch.Tensor]:
    """One page-contiguous region per layer, viewed as attention blocks ``[2, nb, bs, h, d]``."""
    h = spec.heads_per_rank(tp)
    page = spec.bytes_per_token(h, 1) * spec.block_size
    out = []
    for _ in range(spec.num_layers):
        raw = torch.zeros(nb, page, dtype=torch.uint8)
        out.append(raw.view(spec.dtype).view(nb, 2, spec.block_size, h, HEAD_DIM).transpose(0, 1))
    return out


def _engines(name: str, spec: KVCacheSpec, tp: int, nb: int, gdn: int, conv_layout: str, transport: str):
    h = spec.heads_per_rank(tp)
    page = spec.bytes_per_token(h, 1) * spec.block_size
    groups = [AttentionGroup((0,)), StateGroup(tuple(range(1, gdn + 1)), _state(gdn, tp, page, conv_layout))]
    base = free_port_base(tp) if tp > 1 else 0
    kw = {"transport": transport, "lease_s": 60.0, "port": base, "groups": groups, "onesided": False}
    return [TransferEngine(spec, _caches(spec, tp, nb), r, tp, name, **kw).start() for r in range(tp)]


def _wait(engs, rid: str, key: str, timeout: float = 60.0) -> None:
    left = set(range(len(engs)))
    end = time.monotonic() + timeout
    while left and time.monotonic() < end:
        for k in list(left):
            r = engs[k].poll()
            if rid in getattr(r, key):
                left.discard(k)
            if rid in r.failed:
                raise RuntimeError(f"{rid}: {r.errors.get(rid)}")
        time.sleep(0.0005)
    if left:
        raise TimeoutError(f"{rid}: not {key} on ranks {sorted(left)}")


def _copy_ms(nbytes: int, iters: int = 5) -> float:
    """The limit in the same run: a one-thread ``copy_`` of ``nbytes`` contiguous bytes (median
    ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return statistics.median(times[1:]) * 1e3


def _case(transport: str, tp_d: int, gdn: int, tokens: int, block: int, iters: int) -> dict:
    spec = KVCacheSpec(gdn + 1, KV_HEADS, HEAD_DIM, block, torch.bfloat16)
    need = -(-tokens // block)
    nb = (need + 1) * (iters + 1) + 2
    ps = _engines("P", spec, 1, nb, gdn, "SD", transport)
    ds = _engines("D", spec, tp_d, nb, gdn, "DS" if tp_d > 1 else "SD", transport)
    times = []
    try:
        for i in range(iters + 1):  # the first: handshake, mapping or pairing (not counted)
            at = 1 + i * (need + 1)
            lists = [list(range(at, at + need)), [at + need]]
            rid = f"r{i}"
            params = ps[0].export(rid, lists, tokens)
            before = sum(d.stats()["bytes"] for d in ds)
            t0 = time.perf_counter()
            for d in ds:
                d.load(rid, params, lists)
            _wait(ds, rid, "finished_recving")
            if i:
                times.append(time.perf_counter() - t0)
            moved = sum(d.stats()["bytes"] for d in ds) - before
            _wait(ps, rid, "finished_sending")
        state = _state(gdn, 1, None, "SD")
        return {
            "transport": transport,
            "d_tp": tp_d,
            "how": "re-sharded" if tp_d > 1 else "whole page",
            "ms_p50": round(statistics.median(times) * 1e3, 2),
            "ms_min": round(min(times) * 1e3, 2),
            "moved_bytes": moved,
            "copy_ms": round(_copy_ms(moved), 2),
            "state_bytes": state.content_bytes * gdn,
            "kv_bytes": spec.bytes_per_token(KV_HEADS, 1) * tokens,
            "transports": ds[0].stats()["transports"],
        }
    finally:
        for e in ps + ds:
            e.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gdn-layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block", type=int, default=544, help="attention block size (holds one layer's state)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--transports", default="ipc,pg")
    a = ap.parse_args(argv)
    rows = []
    for transport in a.transports.split(","):
        for tp_d in (1, 2):
            rows.append(_case(transport, tp_d, a.gdn_layers, a.tokens, a.block, a.iters))
    head = (
        "transport",
        "D TP",
        "state",
        "p50 ms",
        "min ms",
        "moved MB",
        "copy_ ms",
        "x copy_",
        "state MB",
        "KV MB",
    )
    print("  ".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (r["transport"], r["d_tp"], r["how"], r["ms_p50"], r["ms_min"], f"{r['moved_bytes'] / 1e6:.2f}",
                 r["copy_ms"], f"{r['copy_ms'] / r['ms_p50']:.2f}", f"{r['state_bytes'] / 1e6:.2f}",
                 f"{r['kv_bytes'] / 1e6:.2f}")  # fmt: skip
        print("  ".join(f"{c!s:>10}" for c in cells))
    print(json.dumps({"gdn_layers": a.gdn_layers, "tokens": a.tokens, "block": a.block, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
