"""P -> D through TransferEngine over each transport: latency, bandwidth vs the link, host cost.

The exporter (P) runs in its own process; the loader (D) is this process. For every
(transport, prompt length) a fresh D engine loads one request *cold* (first request to a new
peer: handshake, mapping or pair-group set-up included), then ``--reqs`` requests *warm*, one
at a time (load -> poll until finished). Each row: KV bytes, time (cold, or warm p50/p99),
GB/s at p50, the limit measured in the same run and the fraction of it, D's host-side cost
per request (time inside ``load()`` plus the ``poll()`` that dispatched it), and ``#wrong``:
a verification pass compares a digest of what P holds with what landed on D, per request.

Transports (``--transports``, default ``ipc,pg`` plus ``nixl-direct,nixl-staged`` when NIXL is
installed): ``ipc`` reads one-sided once the first request mapped P (``load()`` copies when P's
lease slot allows: kvxfer.transports.ipc.onesided); ``ipc-messaged`` is the same transport with
one-sided reads off (a lease grant, then the copy in D's worker thread); ``nixl-direct`` loads into a D cache laid out like P's (NHD, block 16: READs of P's
blocks straight into D's), ``nixl-staged`` into the HND block-32 D of the other rows (gather,
READ of staging buffers, scatter). UCX runs as the environment says (``UCX_TLS`` ...);
``UCX_NET_DEVICES`` defaults to ``lo`` (P and D share this host); ``--ucx-tls tcp`` forces the
path a cross-node link without RDMA takes.

With ``--inflight K`` (K > 1) each (transport, prompt length) also gets a row ``xK``: K
requests on disjoint blocks exported together and loaded together (K ``load()`` calls, then
``poll()`` until the last finished), timed from the first ``load()`` to the last finish, GB/s over
all K requests' bytes, p50 over ``--batches`` such rounds: what the path reaches with requests in
flight together (the engine gives a batch one lease grant per source rank and one kernel)
rather than one request at a time.

Limits, measured between the same two processes in the same run:
  ipc   a plain ``copy_`` of the same bytes on the cache device (the copy ipc performs);
  pg    a raw send of the same bytes over a fresh pair group of the backend the engine's pg
        pairs use here, acknowledged by one byte: P and D share one device, so Gloo (through
        pinned host memory for CUDA caches: NCCL cannot put both ranks of a pair on one GPU);
  nixl  the same ``copy_`` as ipc (memcpy on a CPU, a device copy on a GPU): what a transfer
        between two engines on one host could at best reach.

    python profiling/bench_transfer.py [--quick] [--transports ipc,pg,nixl-direct,nixl-staged]
        [--sizes 128,...,32768] [--ucx-tls tcp] [--inflight 8 [--batches 3]]

Outputs: the table on stdout, ``bench_transfer.json`` and ``bench_transfer.png`` under --out.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common

from kvxfer import KVCacheSpec, Layout, TransferEngine
from kvxfer.ops import gather_blocks
from kvxfer.ports import free_port_base

SIZES = [128, 512, 2048, 8192, 32768]
QUICK_SIZES = [128, 1024]
DEADLINE_S = 120.0
POLL_S = 0.0002  # pause between poll() calls while waiting (a model runner's step is longer)


def specs(layers: int) -> tuple[KVCacheSpec, KVCacheSpec]:
    """Llama-3-8B-shaped caches (8 kv heads x 128, bf16): P NHD block 16, D HND block 32."""
    p = KVCacheSpec(layers, 8, 128, 16, torch.bfloat16, Layout.NHD)
    d = KVCacheSpec(layers, 8, 128, 32, torch.bfloat16, Layout.HND)
    return p, d


_ROW_WORDS = 32768  # int32 words per checksum row: column weights 1..32768 are distinct mod 65521
_SLICE_ROWS = 2048  # rows reduced per step: 256 MiB of bytes, 512 MiB of int64 temporaries
_P61 = (1 << 61) - 1


@functools.cache
def _column_weights(device: torch.device) -> torch.Tensor:
    return (torch.arange(_ROW_WORDS, dtype=torch.int64, device=device) * 40503) % 65521 + 1


def digest(wire: torch.Tensor) -> str:
    """A digest of the wire's bytes: blake2b on the host for CPU tensors, :func:`device_digest`
    for CUDA ones (P and D of one run are on one device type, so both take the same one)."""
    if wire.device.type == "cuda":
        return device_digest(wire)
    return hashlib.blake2b(
        wire.contiguous().view(torch.uint8).cpu().numpy().tobytes(), digest_size=16
    ).hexdigest()


def device_digest(wire: torch.Tensor) -> str:
    """A checksum of the wire's bytes, computed where the wire lives: the bytes as int32 words in
    rows of 32768, each row reduced on the device to the sum of word x column weight (exact in
    int64: |word| < 2^31, weight <= 65521, 2^15 columns), the row sums combined on the host
    mod 2^61 - 1 with a weight per row; a tail of under one row is hashed with blake2b.

    Any one changed word changes its row's sum (the weights are non-zero mod 2^61 - 1), and a
    swap of two differing words, rows or blocks moves them to other weights. On a GPU it
    replaced a blake2b of the whole wire on the host: checking 8 requests of 512 MiB, three
    rounds, took longer than the device call's step limit on the H200 (2026-11-26). On the
    2-core CPU machine blake2b is faster (0.6 against 1.5 s for 512 MiB)."""
    raw = wire.contiguous().view(torch.uint8).reshape(-1)
    row_bytes = 4 * _ROW_WORDS
    num_rows = raw.numel() // row_bytes
    body, tail = raw[: num_rows * row_bytes], raw[num_rows * row_bytes :]
    words = body.view(torch.int32).view(num_rows, _ROW_WORDS) if num_rows else None
    weights = _column_weights(raw.device)
    sums: list[int] = []
    for r0 in range(0, num_rows, _SLICE_ROWS):
        block = words[r0 : r0 + _SLICE_ROWS].to(torch.int64)
        sums += block.mul_(weights).sum(dim=1).tolist()
    acc = 0
    for r, s in enumerate(sums):
        acc = (acc + (s % _P61) * pow(1_000_003, r + 1, _P61)) % _P61
    h = hashlib.blake2b(tail.cpu().numpy().tobytes(), digest_size=8).hexdigest()
    return f"{raw.numel()}:{acc:016x}:{h}"


def mappable_caches(spec, num_blocks: int, device: torch.device, fill: bool):
    """Caches the ``ipc`` transport can map (shared memory on a CPU, device memory on a GPU),
    filled with seeded noise or zeros; returns (the shared memory to close or None, caches)."""
    from kvxfer.transports.ipc.shm import alloc_shm_caches

    if device.type == "cpu":
        shm = alloc_shm_caches(spec, num_blocks, 1, fill=0)
        caches = shm.caches
    else:
        shm = None
        caches = [
            torch.zeros(spec.cache_shape(num_blocks, 1), dtype=spec.dtype, device=device)
            for _ in range(spec.num_layers)
        ]
    if fill:  # drawn where the caches live: 4 GiB of P caches (--inflight 8) on the host was slow
        g = torch.Generator(device=device).manual_seed(0)
        for c in caches:
            u8 = c.view(torch.uint8)
            u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8, device=device))
    return shm, caches


# ----------------------------------------------------------------------------- exporter process
def exporter(args: dict, cmd_q, reply_q) -> None:
    """P: one engine over caches filled with seeded noise; serves "export", "link", "stop"."""
    try:
        _exporter(args, cmd_q, reply_q)
    except BaseException as e:  # report, never hang the parent
        reply_q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _exporter(args: dict, cmd_q, reply_q) -> None:
    from kvxfer.transports.pg import groups as pg

    p_spec, _ = specs(args["layers"])
    nb = p_spec.num_blocks_for(max(args["sizes"]))
    nb_all = nb * max(1, args["inflight"])  # room for K requests on disjoint blocks
    device = torch.device(args["device"])
    shm, caches = mappable_caches(p_spec, nb_all, device, fill=True)
    eng = TransferEngine(p_spec, caches, 0, 1, "P", transport="auto", port=args["port"], lease_s=60.0).start()
    store = pg.serve_store("127.0.0.1", 60.0)
    reply_q.put(("ready", store.port))
    live: set[str] = set()
    link_groups: dict[str, object] = {}
    ids = list(range(nb))
    deadline = time.monotonic() + args["deadline_s"]
    while time.monotonic() < deadline:
        r = eng.poll()
        live -= r.finished_sending | r.expired
        try:
            cmd = cmd_q.get(timeout=0.001)
        except Exception:
            continue
        if cmd[0] == "stop":
            break
        if cmd[0] == "export":
            _, rid, n = cmd
            while live and time.monotonic() < deadline:  # the blocks are reused: wait for release
                r = eng.poll()
                live -= r.finished_sending | r.expired
                time.sleep(0.0005)
            params = eng.export(rid, ids, n)
            live.add(rid)
            want = digest(gather_blocks(caches, p_spec, ids, n)) if args["verify"] else None
            reply_q.put(("params", params, want))
        elif cmd[0] == "export_many":  # K requests on disjoint blocks, exported together
            _, rids, n = cmd
            while live and time.monotonic() < deadline:
                r = eng.poll()
                live -= r.finished_sending | r.expired
                time.sleep(0.0005)
            per = p_spec.num_blocks_for(n)
            out = []
            for k, rid in enumerate(rids):
                ids_k = list(range(k * per, (k + 1) * per))
                params = eng.export(rid, ids_k, n)
                live.add(rid)
                want = digest(gather_blocks(caches, p_spec, ids_k, n)) if args["verify"] else None
                out.append((params, want))
            reply_q.put(("params_many", out))
        elif cmd[0] == "link":  # raw send/recv of nbytes, iters + warmup times, acknowledged
            _, key, nbytes, rounds = cmd
            backend, where, pinned = _link_kind(device)
            if key not in link_groups:
                link_groups[key] = pg.new_pair(store, key, 0, "127.0.0.1", 60.0, backend)
            group = link_groups[key]
            buf = torch.empty(nbytes, dtype=torch.uint8, device=where, pin_memory=pinned)
            ack = torch.ones(1, dtype=torch.uint8, device=where, pin_memory=pinned)
            for _ in range(rounds):
                pg.recv_tensor(group, buf, 1, 60.0)
                pg.send_tensor(group, ack, 1, 60.0)
    reply_q.put(("stats", eng.stats()))
    eng.close()
    if shm is not None:
        shm.close()


# ----------------------------------------------------------------------------- loader side
def _get(reply_q, kind: str, proc) -> tuple:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        try:
            msg = reply_q.get(timeout=0.5)
        except Exception:
            if not proc.is_alive():
                raise RuntimeError("the exporter process died") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"exporter failed: {msg[1]}")
        if msg[0] == kind:
            return msg
    raise TimeoutError(f"no {kind!r} from the exporter within {DEADLINE_S}s")


def load_one(eng: TransferEngine, rid: str, params: dict, ids: list[int]) -> tuple[float, float, float]:
    """Load one request and poll until it finished: ``perf_counter`` at ``load()``, after the
    ``poll()`` that dispatched it, and when a poll reported it finished."""
    t0 = time.perf_counter()
    eng.load(rid, params, ids)
    r = eng.poll()
    t_call = time.perf_counter()
    end = time.monotonic() + DEADLINE_S
    while rid not in r.finished_recving:
        if rid in r.failed:
            raise RuntimeError(f"{rid} failed: {r.errors.get(rid)}")
        if time.monotonic() > end:
            raise TimeoutError(f"{rid} did not finish within {DEADLINE_S}s")
        # Poll like a scheduler step does: a tight poll() loop would starve the engine's own
        # threads of the GIL (measured: 1 MiB ipc load 2.5 ms with this pause, 100-460 ms without).
        time.sleep(POLL_S)
        r = eng.poll()
    return t0, t_call, time.perf_counter()


def load_many(eng: TransferEngine, loads: list[tuple[str, dict, list[int]]]) -> tuple[float, float, float]:
    """Load every ``(request id, params, local ids)`` of ``loads`` at once and poll until all
    finished: ``perf_counter`` at the first ``load()``, after the ``poll()`` that dispatched
    them, and when a poll reported the last one finished."""
    t0 = time.perf_counter()
    for rid, params, ids in loads:
        eng.load(rid, params, ids)
    r = eng.poll()
    t_call = time.perf_counter()
    left = {rid for rid, _, _ in loads}
    end = time.monotonic() + DEADLINE_S
    while True:
        left -= r.finished_recving
        failed = left & set(r.failed)
        if failed:
            rid = sorted(failed)[0]
            raise RuntimeError(f"{rid} failed: {r.errors.get(rid)}")
        if not left:
            return t0, t_call, time.perf_counter()
        if time.monotonic() > end:
            raise TimeoutError(f"{sorted(left)} did not finish within {DEADLINE_S}s")
        time.sleep(POLL_S)
        r = eng.poll()


def _inflight_rounds(
    a: argparse.Namespace, eng: TransferEngine, transport: str, n: int, d_spec, caches, cmd_q, reply_q, proc
) -> tuple[list[float], list[float], list[int]]:
    """``a.batches`` rounds of ``a.inflight`` requests loaded together: per round its wall
    time, D's host time per request and its number of wrong requests."""
    per = d_spec.num_blocks_for(n)
    walls, hosts, wrong = [], [], []
    for b in range(a.batches):
        rids = [f"{transport}-{n}-x{a.inflight}-{b}-{k}" for k in range(a.inflight)]
        cmd_q.put(("export_many", rids, n))
        got = _get(reply_q, "params_many", proc)[1]
        d_ids = [list(range((k + 1) * per - 1, k * per - 1, -1)) for k in range(a.inflight)]
        t0, t_call, t_done = load_many(eng, [(rid, g[0], ids) for rid, g, ids in zip(rids, got, d_ids)])
        if a.corrupt:  # prove the verification can fail: flip one landed byte
            caches[0].view(torch.uint8).view(-1)[0].bitwise_not_()  # block 0 is request 0's
        wrong.append(
            sum(
                int(want is not None and digest(gather_blocks(caches, d_spec, ids, n)) != want)
                for (_, want), ids in zip(got, d_ids)
            )
        )
        walls.append(t_done - t0)
        hosts.append((t_call - t0) / a.inflight)
    return walls, hosts, wrong


def _link_kind(device: torch.device) -> tuple[str, str, bool]:
    """(backend, buffer device, pinned) of the raw pg link between P and D here. Both run on
    one device, where NCCL cannot put the two ranks of a pair, so CUDA caches travel over Gloo
    through pinned host memory, as the engine's pg pairs do on one GPU."""
    if device.type == "cuda":
        return "gloo", "cpu", True
    return "gloo", "cpu", False


def _link_limit(
    transport: str, nbytes: int, device: torch.device, store_port: int, cmd_q, iters: int
) -> tuple[float, str]:
    """Median seconds of the transport's raw link for ``nbytes`` (see module doc)."""
    if transport.startswith(("ipc", "nixl")):
        kind = "d2d" if device.type == "cuda" else "cpu"
        return common.CopyLimit(device).measure(nbytes, kind, iters, 1), f"copy_{kind}"
    from kvxfer.transports.pg import groups as pg

    key = f"link-{nbytes}-{time.monotonic_ns()}"
    rounds = iters + 1
    cmd_q.put(("link", key, nbytes, rounds))
    store = pg.connect_store("127.0.0.1", store_port, 60.0)
    backend, where, pinned = _link_kind(device)
    group = pg.new_pair(store, key, 1, "127.0.0.1", 60.0, backend)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=where, pin_memory=pinned)
    ack = torch.empty(1, dtype=torch.uint8, device=where, pin_memory=pinned)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        pg.send_tensor(group, buf, 0, 60.0)
        pg.recv_tensor(group, ack, 0, 60.0)
        common.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), f"{backend}_send" + ("_pinned" if pinned else "")


def default_transports() -> str:
    """``ipc,pg``, and both nixl paths when NIXL can be imported."""
    from kvxfer.transports.nixl.agent import nixl_status

    return "ipc,pg" + ("" if nixl_status() else ",nixl-direct,nixl-staged")


def run(a: argparse.Namespace) -> int:
    device = common.pick_device(a.device)
    p_spec, d_spec_staged = specs(a.layers)
    sizes = a.size_list or (QUICK_SIZES if a.quick else SIZES)
    transports = (a.transports or default_transports()).split(",")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before the exporter spawns: both are here
    if a.ucx_tls:
        os.environ["UCX_TLS"] = a.ucx_tls
    ctx = mp.get_context("spawn")
    cmd_q, reply_q = ctx.Queue(), ctx.Queue()
    port = free_port_base(1)
    args = {
        "layers": a.layers,
        "device": str(device),
        "sizes": sizes,
        "port": port,
        "verify": True,
        "inflight": a.inflight,
        "deadline_s": DEADLINE_S * (len(sizes) * len(transports) + 2),
    }
    proc = ctx.Process(target=exporter, args=(args, cmd_q, reply_q), daemon=True)
    proc.start()
    rows: list[dict] = []
    meta = common.run_metadata(device)
    cols = [
        common.Column("transport", "transport", 13),
        common.Column("phase", "phase", 5),
        common.Column("tokens", "tokens", 6),
        common.Column("bytes", "bytes", 11),
        common.Column("p50_ms", "p50(ms)", 9, "{:.3f}"),
        common.Column("p99_ms", "p99(ms)", 9, "{:.3f}"),
        common.Column("gbps", "GB/s", 8, "{:.2f}"),
        common.Column("limit_kind", "limit", 11),
        common.Column("limit_gbps", "limit GB/s", 10, "{:.2f}"),
        common.Column("pct_limit", "%limit", 7, "{:.1f}"),
        common.Column("host_us", "host us/req", 11, "{:.1f}"),
        common.Column("wrong", "#wrong", 6),
    ]
    table = common.Table(cols, common.table_writer())
    table.header(
        [
            f"kvxfer bench_transfer on {meta['device']} ({device.type}), {meta['date']}",
            f"P tp=1 NHD block 16 -> D tp=1 HND block 32 (nixl-direct: NHD block 16), {a.layers} layers "
            "x 8 kv heads x 128, bf16"
            + (
                f"; UCX_TLS={os.environ['UCX_TLS']}"
                if any(t.startswith("nixl") for t in transports) and os.environ.get("UCX_TLS")
                else ""
            ),
            f"command: {meta['command']}",
        ]
    )
    failures = 0
    try:
        store_port = _get(reply_q, "ready", proc)[1]
        work = [(t, n) for t in transports for n in sizes]
        for transport, n in common.progress(work, "bench_transfer"):
            d_spec = p_spec if transport == "nixl-direct" else d_spec_staged
            nbytes = n * p_spec.bytes_per_token()
            d_ids = list(range(d_spec.num_blocks_for(n)))[::-1]
            d_blocks = len(d_ids) * max(1, a.inflight)  # room for the in-flight rounds
            caches = [
                torch.zeros(d_spec.cache_shape(d_blocks, 1), dtype=d_spec.dtype, device=device)
                for _ in range(d_spec.num_layers)
            ]
            eng = TransferEngine(
                d_spec,
                caches,
                0,
                1,
                f"D-{transport}-{n}",
                transport="nixl" if transport.startswith("nixl") else transport.split("-")[0],
                lease_s=60.0,
                onesided=transport != "ipc-messaged",
            ).start()
            try:
                walls, hosts, wrong = [], [], []
                for i in range(1 + a.reqs):
                    rid = f"{transport}-{n}-{i}"
                    cmd_q.put(("export", rid, n))
                    _, params, want = _get(reply_q, "params", proc)
                    t0, t_call, t_done = load_one(eng, rid, params, d_ids)
                    wall, host = t_done - t0, t_call - t0
                    if a.corrupt:  # prove the verification can fail: flip one landed byte
                        caches[0].view(torch.uint8).view(-1)[0].bitwise_not_()  # block 0 is in d_ids
                    wrong.append(
                        int(want is not None and digest(gather_blocks(caches, d_spec, d_ids, n)) != want)
                    )
                    walls.append(wall)
                    hosts.append(host)
                many = (
                    _inflight_rounds(a, eng, transport, n, d_spec, caches, cmd_q, reply_q, proc)
                    if a.inflight > 1
                    else ([], [], [])
                )
                limit_s, limit_kind = _link_limit(transport, nbytes, device, store_port, cmd_q, a.iters)
                used = eng.stats().get("transports", {})
                reasons = eng.stats().get("transport_reasons", {})
            finally:
                eng.close()
            limit_gbps = nbytes / limit_s / 1e9
            phases = [
                ("cold", walls[:1], hosts[:1], wrong[:1], 1),
                ("warm", walls[1:], hosts[1:], wrong[1:], 1),
                (f"x{a.inflight}", *many, a.inflight),
            ]
            for phase, sel, sel_hosts, sel_wrong, k in phases:
                if not sel:
                    continue
                p50 = statistics.median(sel)
                p99 = sorted(sel)[min(len(sel) - 1, round(0.99 * (len(sel) - 1)))]
                gbps = k * nbytes / p50 / 1e9
                row = {
                    "transport": transport,
                    "used": used,
                    "reasons": reasons,
                    "phase": phase,
                    "tokens": n,
                    "bytes": k * nbytes,  # moved in the time measured (K requests' in an xK row)
                    "p50_ms": p50 * 1e3,
                    "p99_ms": p99 * 1e3,
                    "gbps": gbps,
                    "limit_kind": limit_kind,
                    "limit_gbps": limit_gbps,
                    "pct_limit": 100 * gbps / limit_gbps,
                    "host_us": statistics.median(sel_hosts) * 1e6,
                    "wrong": sum(sel_wrong),
                    "requests": k * len(sel),
                    "inflight": k,
                }
                rows.append(row)
                table.row(row)
            failures += sum(wrong) + sum(many[2])
    finally:
        cmd_q.put(("stop",))
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    os.makedirs(a.out, exist_ok=True)
    common.write_json(os.path.join(a.out, "bench_transfer.json"), meta, rows)
    common.plot_bandwidth(
        rows,
        os.path.join(a.out, "bench_transfer.png"),
        "kvxfer P->D transfer",
        panel=lambda r: r["phase"],
        label=lambda r: r["transport"],
    )
    print(f"# rows: {len(rows)}  wrong requests: {failures}  {'OK' if failures == 0 else 'WRONG'}")
    return 1 if failures else 0


TRANSPORTS = ("ipc", "ipc-messaged", "pg", "nixl-direct", "nixl-staged")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, its values checked (``size_list`` added: [] for the default sizes)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 layers, small sizes (CI on CPU)")
    p.add_argument("--transports", default=None, help="default ipc,pg (+ nixl-direct,nixl-staged with NIXL)")
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for the nixl rows (e.g. tcp)")
    p.add_argument("--sizes", default=None, help="comma list of prompt lengths (default 128..32768)")
    p.add_argument("--layers", type=int, default=None, help="default 32 (quick: 2)")
    p.add_argument("--reqs", type=int, default=None, help="warm requests per row (default 10, quick 3)")
    p.add_argument("--iters", type=int, default=None, help="link-limit iterations (default 10, quick 3)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    p.add_argument("--out", default=common.DEFAULT_OUT)
    p.add_argument("--corrupt", action="store_true", help="flip a landed byte (tests the #wrong check)")
    p.add_argument("--inflight", type=int, default=0, help="K > 1: also a row of K requests loaded together")
    p.add_argument("--batches", type=int, default=3, help="rounds of the --inflight row (default 3)")
    a = p.parse_args(argv)
    if a.inflight < 0 or a.batches < 1:
        p.error("--inflight must be >= 0 and --batches >= 1")
    bad = [t for t in (a.transports or "").split(",") if a.transports and t not in TRANSPORTS]
    if bad:
        p.error(f"--transports: unknown {bad} ({', '.join(TRANSPORTS)})")
    try:
        a.size_list = [int(x) for x in a.sizes.split(",")] if a.sizes else []
    except ValueError:
        p.error(f"--sizes: {a.sizes!r} is not a comma list of token counts")
    if not all(n >= 1 for n in a.size_list):
        p.error(f"--sizes: {a.sizes!r}: each count must be >= 1")
    a.layers = a.layers or (2 if a.quick else 32)
    a.reqs = a.reqs if a.reqs is not None else (3 if a.quick else 10)
    a.iters = a.iters or (3 if a.quick else 10)
    return a


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
