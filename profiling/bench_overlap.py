"""Layer-wise export vs whole-request export: the transfer's tail after the prefill.

P (its own process) runs a simulated prefill that takes ``--layer-ms`` per layer per 1K tokens
(CPU: a sleep; ``--device cuda``: the same time of matrix products on the compute stream) and
writes each layer of the request's KV as it goes. *whole*: P exports when the prefill ends;
*layer-wise*: P exports with ``streaming=True`` when it starts and marks each layer ready
(with the event of the compute that wrote it). D (this process) loads the request and polls
like a scheduler. Each row: the prefill time, and the **tail** — from the prefill's end to
D holding every layer — for both modes, median of ``--reqs`` requests, with ``#wrong`` from a
byte comparison of what landed. Goal (issue 16): the layer-wise tail is at most about one
layer group's transfer, >= 5x shorter than whole-request at 4K tokens on CPU with 32 layers.

    python profiling/bench_overlap.py [--quick] [--sizes 1024,4096,16384] [--layers 32] [--transport ipc]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common

from kvxfer import KVCacheSpec, Layout, TransferEngine, ops
from kvxfer.ports import free_port_base

POLL_S = 0.0002


def _spec(layers: int, block_size: int = 16, layout: str = "NHD") -> KVCacheSpec:
    return KVCacheSpec(layers, 8, 128, block_size, torch.bfloat16, Layout(layout))


def _wire(spec: KVCacheSpec, n: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = spec.wire_shape(n)
    raw = torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16)
    return raw.view(spec.dtype).to(device)


def prefill(args: dict, q_out, q_in) -> None:
    try:
        _prefill(args, q_out, q_in)
    except BaseException as e:
        q_out.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _prefill(args: dict, q_out, q_in) -> None:
    from kvxfer.transports.ipc.shm import alloc_shm_caches

    spec = _spec(args["layers"])
    dev = torch.device(args["device"])
    nb = spec.num_blocks_for(max(args["sizes"])) + 1
    shm = None
    if dev.type == "cpu":
        shm = alloc_shm_caches(spec, nb, 1)
        caches = shm.caches
    else:
        caches = [
            torch.zeros(spec.cache_shape(nb, 1), dtype=spec.dtype, device=dev) for _ in range(spec.num_layers)
        ]
    eng = TransferEngine(
        spec, caches, 0, 1, "P", transport=args["transport"], port=args["port"], lease_s=60.0, timeout_s=60.0
    ).start()
    compute = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    mat = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16) if dev.type == "cuda" else None
    q_out.put(("ready", None))
    while True:
        job = q_in.get(timeout=600)
        if job is None:
            break
        rid, n, mode, seed = job
        ids = list(range(spec.num_blocks_for(n)))
        wire = _wire(spec, n, seed, dev)
        layer_s = args["layer_ms"] * n / 1024 / 1000
        if mode == "layer-wise":
            q_out.put(("params", rid, eng.export(rid, ids, n, streaming=True)))
        t0 = time.monotonic()
        for layer in range(spec.num_layers):
            if compute is None:
                time.sleep(layer_s)  # the layer's attention and MLP
                ops.scatter_blocks(
                    wire[:, layer : layer + 1].contiguous(), caches, spec, ids, n, layers=[layer]
                )
                ready = None
            else:
                with torch.cuda.stream(compute):
                    t_end = time.monotonic() + layer_s
                    while time.monotonic() < t_end:
                        mat @ mat
                    ops.scatter_blocks(
                        wire[:, layer : layer + 1].contiguous(), caches, spec, ids, n, layers=[layer]
                    )
                    ready = torch.cuda.Event()
                    ready.record(compute)
            if mode == "layer-wise":
                eng.mark_ready(rid, [layer], ready=ready)
        if compute is not None:
            compute.synchronize()
        t_end = time.monotonic()
        if mode == "whole":
            q_out.put(("params", rid, eng.export(rid, ids, n)))
        q_out.put(("prefill", rid, t_end - t0, t_end))
        end = time.monotonic() + 60
        while time.monotonic() < end:
            r = eng.poll()
            if rid in r.finished_sending or rid in r.expired:
                break
            time.sleep(0.001)
    eng.close()
    if shm is not None:
        shm.close()
    q_out.put(("done", None))


def run(a: argparse.Namespace) -> int:
    device = common.pick_device(a.device)
    sizes = (
        [int(s) for s in a.sizes.split(",")] if a.sizes else ([256, 1024] if a.quick else [1024, 4096, 16384])
    )
    layers = a.layers or (8 if a.quick else 32)
    spec = _spec(layers)
    dspec = _spec(layers, 32, "HND")
    port = free_port_base(1)
    args = {
        "layers": layers,
        "sizes": sizes,
        "device": str(device),
        "transport": a.transport,
        "port": port,
        "layer_ms": a.layer_ms,
    }
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill, args=(args, q_out, q_in), daemon=True)
    proc.start()
    write = common.table_writer()
    meta = common.run_metadata(device)
    rows = []
    nb = dspec.num_blocks_for(max(sizes)) + 1
    if device.type == "cpu":
        from kvxfer.transports.ipc.shm import alloc_shm_caches

        dshm = alloc_shm_caches(dspec, nb, 1)
        dcaches = dshm.caches
    else:
        dshm = None
        dcaches = [
            torch.zeros(dspec.cache_shape(nb, 1), dtype=dspec.dtype, device=device) for _ in range(layers)
        ]
    d = TransferEngine(dspec, dcaches, 0, 1, "D", transport=a.transport, timeout_s=60.0).start()

    def get(kind):
        while True:
            msg = q_out.get(timeout=600)
            if msg[0] == "error":
                raise RuntimeError(msg[1])
            if msg[0] == kind:
                return msg

    wrong = 0
    try:
        get("ready")
        cols = [
            common.Column("tokens", "tokens", 7),
            common.Column("mode", "mode", 10),
            common.Column("prefill_ms", "prefill(ms)", 11, "{:.1f}"),
            common.Column("tail_ms", "tail(ms)", 9, "{:.2f}"),
            common.Column("tail_vs_whole", "x shorter", 9, "{:.1f}"),
            common.Column("wrong", "#wrong", 7),
        ]
        table = common.Table(cols, write)
        table.header(
            [
                f"kvxfer bench_overlap  device: {meta['device']}  transport: {a.transport}  layers: {layers}  "
                f"layer time: {a.layer_ms} ms per 1K tokens  commit {meta['git_commit']}",
                "tail = prefill end -> D holds every layer (median of the requests); x shorter = whole tail / this tail",
            ]
        )
        k = 0
        for n in sizes:
            tails: dict[str, float] = {}
            for mode in ("whole", "layer-wise"):
                per, pre = [], []
                for _ in range(a.reqs):
                    rid = f"r{k}"
                    k += 1
                    q_in.put((rid, n, mode, k))
                    ids = list(range(dspec.num_blocks_for(n)))
                    if mode == "layer-wise":  # params at the start of the prefill
                        _, _, params = get("params")
                        d.load(rid, params, ids)
                    t_done = None
                    loaded = mode == "layer-wise"
                    t_end = None
                    while t_done is None:
                        if not loaded:
                            try:
                                msg = q_out.get_nowait()
                            except Exception:
                                msg = None
                            if msg and msg[0] == "error":
                                raise RuntimeError(msg[1])
                            if msg and msg[0] == "params":
                                d.load(rid, msg[2], ids)
                                loaded = True
                            elif msg and msg[0] == "prefill":
                                t_end, p_s = msg[3], msg[2]
                                pre.append(p_s)
                        r = d.poll()
                        if rid in r.failed:
                            raise RuntimeError(f"{rid}: {r.errors.get(rid)}")
                        if rid in r.finished_recving:
                            common.synchronize(device)
                            t_done = time.monotonic()
                        time.sleep(POLL_S)
                    if t_end is None:
                        _, _, p_s, t_end = get("prefill")
                        pre.append(p_s)
                    per.append(max(0.0, t_done - t_end))
                    got = ops.gather_blocks(dcaches, dspec, ids, n).cpu()
                    want = _wire(spec, n, k, "cpu")
                    wrong += int(not torch.equal(got.view(torch.int16), want.view(torch.int16)))
                tails[mode] = statistics.median(per)
                row = {
                    "tokens": n,
                    "mode": mode,
                    "prefill_ms": statistics.median(pre) * 1e3,
                    "tail_ms": tails[mode] * 1e3,
                    "tail_vs_whole": tails["whole"] / tails[mode] if tails[mode] > 0 else float("inf"),
                    "wrong": wrong,
                }
                rows.append(row)
                table.row(row)
        q_in.put(None)
        get("done")
    finally:
        d.close()
        if dshm is not None:
            dshm.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    goal = [r for r in rows if r["mode"] == "layer-wise" and r["tokens"] == 4096]
    if goal:
        ratio = goal[0]["tail_vs_whole"]
        write(
            f"# 4K tokens: layer-wise tail {ratio:.1f}x shorter than whole (goal >= 5x): {'met' if ratio >= 5 else 'NOT met'}"
        )
    write(f"# wrong requests: {wrong}  {'OK' if wrong == 0 else 'FAILED'}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        common.write_json(os.path.join(a.out, "bench_overlap.json"), meta, rows)
    print(json.dumps({"bench": "overlap", "rows": rows}))
    return 0 if wrong == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 layers, 256/1K tokens (CI on CPU)")
    p.add_argument("--sizes", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument(
        "--layer-ms", type=float, default=2.0, help="simulated prefill time per layer per 1K tokens"
    )
    p.add_argument("--reqs", type=int, default=3)
    p.add_argument("--transport", default="ipc", choices=["ipc", "pg"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
