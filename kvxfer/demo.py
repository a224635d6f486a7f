"""Demo: a prefill engine (tp=2, NHD, block 16) hands three requests to a decode engine (tp=1,
HND, block 32) through TransferEngine, each rank in its own process; D verifies every byte.

    python -m kvxfer.demo [--transport auto|ipc|pg] [--device auto|cpu|cuda]
                          [--layers 32] [--tokens 1000 2500 377]

On a machine with a GPU the caches live on it (kernels move the data, CUDA IPC between the
processes); otherwise on the CPU (shared memory or Gloo). The demo says which it used.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import torch

TP_P, TP_D = 2, 1


def _specs(num_layers: int):
    from . import KVCacheSpec, Layout

    p = KVCacheSpec(num_layers, 8, 128, 16, torch.bfloat16, Layout.NHD)
    d = KVCacheSpec(num_layers, 8, 128, 32, torch.bfloat16, Layout.HND)
    return p, d


def _truth(spec, request: int, heads: range, num_tokens: int, device: str) -> torch.Tensor:
    """What prefill computed for ``heads`` of request ``request`` (a wire tensor), reproducibly."""
    parts = []
    for h in heads:  # one generator per (request, head): any rank can rebuild its own heads
        g = torch.Generator().manual_seed(request * 1000 + h)
        shape = spec.wire_shape(num_tokens, 1)
        parts.append(torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16))
    return torch.cat(parts).view(spec.dtype).to(device)


def _block_lists(lengths: list[int], block_size: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled block lists, one per request (as a paged allocator hands them out)."""
    need = [-(-n // block_size) for n in lengths]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    out, start = [], 0
    for n in need:
        out.append(perm[start : start + n])
        start += n
    return out


def _prefill_rank(rank: int, args: dict, q_params, q_result) -> None:
    from . import TransferEngine
    from .ops import scatter_blocks
    from .transports.ipc.shm import alloc_shm_caches

    p_spec, _ = _specs(args["layers"])
    lengths, device = args["tokens"], args["device"]
    ids = _block_lists(lengths, p_spec.block_size, seed=1)
    num_blocks = sum(map(len, ids))
    if device == "cpu":
        shm = alloc_shm_caches(p_spec, num_blocks, TP_P)  # shared memory: D can map it (ipc)
        caches = shm.caches
    else:
        shm = None
        caches = [
            torch.zeros(p_spec.cache_shape(num_blocks, TP_P), dtype=p_spec.dtype, device=device)
            for _ in range(p_spec.num_layers)
        ]
    eng = TransferEngine(
        p_spec, caches, rank, TP_P, "prefill", transport=args["transport"], port=args["p_port"]
    ).start()
    heads = p_spec.heads_of_rank(rank, TP_P)
    params = []
    for i, (blocks, n) in enumerate(zip(ids, lengths)):
        scatter_blocks(_truth(p_spec, i, heads, n, device), caches, p_spec, blocks, n)  # "prefill"
        params.append(eng.export(f"req-{i}", blocks, n))
    q_params.put(params)  # every rank: D starts once all of P's ranks listen and hold the exports
    done: set[str] = set()
    deadline = time.monotonic() + args["deadline_s"]
    while len(done) < len(lengths) and time.monotonic() < deadline:
        r = eng.poll()
        done |= r.finished_sending | r.expired
        time.sleep(0.002)
    q_result.put((f"prefill rank {rank}", eng.stats()))
    eng.close()
    if shm is not None:
        shm.close()


def _decode_rank(args: dict, q_params, q_result) -> None:
    from . import TransferEngine
    from .ops import gather_blocks, last_backend

    _, d_spec = _specs(args["layers"])
    lengths, device = args["tokens"], args["device"]
    ids = _block_lists(lengths, d_spec.block_size, seed=2)
    caches = [
        torch.zeros(d_spec.cache_shape(sum(map(len, ids)), TP_D), dtype=d_spec.dtype, device=device)
        for _ in range(d_spec.num_layers)
    ]
    eng = TransferEngine(d_spec, caches, 0, TP_D, "decode", transport=args["transport"]).start()
    # the params are the same on every P rank; D waits for all (a server answers only once
    # every one of its ranks is up: a rank not listening yet refuses the handshake at once)
    per_rank = [q_params.get(timeout=args["deadline_s"]) for _ in range(TP_P)]
    params = per_rank[0]
    start = time.perf_counter()
    for i, (p, blocks) in enumerate(zip(params, ids)):
        eng.load(f"req-{i}", p, blocks)
    got, failed = set(), {}
    deadline = time.monotonic() + args["deadline_s"]
    while len(got) + len(failed) < len(lengths) and time.monotonic() < deadline:
        r = eng.poll()
        got |= r.finished_recving
        failed.update({k: r.errors.get(k, "failed") for k in r.failed})
        time.sleep(0.001)
    elapsed = time.perf_counter() - start
    verified = 0
    for i, (blocks, n) in enumerate(zip(ids, lengths)):
        if f"req-{i}" in got:
            want = _truth(d_spec, i, range(d_spec.num_kv_heads), n, device)
            have = gather_blocks(caches, d_spec, blocks, n)
            verified += bool(torch.equal(have.view(torch.uint8), want.view(torch.uint8)))
    q_result.put(
        (
            "decode",
            {
                "stats": eng.stats(),
                "elapsed": elapsed,
                "got": sorted(got),
                "failed": failed,
                "verified": verified,
                "backend": last_backend(),
            },
        )
    )
    eng.close()


def run(num_layers: int, lengths: list[int], transport: str, device: str, deadline_s: float = 60.0) -> bool:
    from .ports import free_port_base

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    args = {
        "layers": num_layers,
        "tokens": lengths,
        "transport": transport,
        "device": device,
        "p_port": free_port_base(TP_P),
        "deadline_s": deadline_s,
    }
    ctx = mp.get_context("spawn")
    q_params, q_result = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_prefill_rank, args=(r, args, q_params, q_result), daemon=True)
        for r in range(TP_P)
    ]
    procs.append(ctx.Process(target=_decode_rank, args=(args, q_params, q_result), daemon=True))
    for p in procs:
        p.start()
    results: dict = {}
    end = time.monotonic() + deadline_s + 30
    while len(results) < len(procs) and time.monotonic() < end:
        try:
            name, val = q_result.get(timeout=0.5)
            results[name] = val
        except Exception:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=max(0.1, end - time.monotonic()))
        if p.is_alive():
            p.kill()
    p_spec, _ = _specs(num_layers)
    dec = results.get("decode")
    print(
        f"kvxfer demo on {device.upper()}: prefill tp={TP_P} NHD block 16 -> decode tp={TP_D} HND block 32, "
        f"{num_layers} layers x 8 kv heads x 128, bf16, each rank its own process"
    )
    if dec is None:
        print(f"  FAILED: the decode process did not report ({sorted(results)} did)")
        return False
    s = dec["stats"]
    total = sum(lengths)
    nbytes = total * p_spec.bytes_per_token()
    print(f"  transport: {s.get('transports')}  copy backend: {dec['backend']}")
    print(
        f"  requests: {len(lengths)}  tokens: {total} ({', '.join(map(str, lengths))})  "
        f"KV bytes: {nbytes / 2**20:.1f} MiB"
    )
    print(
        f"  load -> all finished: {dec['elapsed'] * 1e3:.1f} ms = {nbytes / dec['elapsed'] / 1e9:.2f} GB/s "
        "(includes handshake with a new peer)"
    )
    print(f"  verified byte for byte: {dec['verified']}/{len(lengths)}   failed: {dec['failed'] or 'none'}")
    for name in sorted(results):
        st = results[name] if name != "decode" else s
        keys = (
            "transfers",
            "bytes",
            "bytes_sent",
            "dedup_bytes",
            "failures",
            "expirations",
            "finished_exports",
            "handshake_s",
            "p50_s",
            "p99_s",
            "throughput_Bps",
            "ops_calls",
        )
        print(
            f"  stats[{name}]: "
            + ", ".join(
                f"{k}={st[k]:.4g}" if isinstance(st[k], float) else f"{k}={st[k]}" for k in keys if k in st
            )
        )
    return dec["verified"] == len(lengths) and not dec["failed"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 2500, 377])
    ap.add_argument("--transport", choices=["auto", "ipc", "pg"], default="auto")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--deadline", type=float, default=60.0, help="seconds before giving up")
    a = ap.parse_args(argv)
    return 0 if run(a.layers, a.tokens, a.transport, a.device, a.deadline) else 1


if __name__ == "__main__":
    sys.exit(main())
