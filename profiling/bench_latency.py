"""Where one request's time goes: P and D in two processes, the engine's own NVTX ranges recorded
without Nsight, printed as a timeline.

The exporter (P) runs in its own process, the loader (D) in this one, as in
``bench_transfer.py`` (P NHD block 16, D HND block 32, Llama-3-8B-shaped bf16 caches). Both
processes replace the ``nvtx`` module with a recorder (``kvxfer.tracing.set_enabled``), so the
ranges an Nsight user would see (``kvxfer.load``, ``grant``, ``copy`` / ``recv`` + ``scatter``,
``wait``, ``notify`` on D; ``serve <message>``, ``gather``, ``send`` on P) come back with their
start and end on one clock (``time.perf_counter``, CLOCK_MONOTONIC: the same in both
processes). Each warm request is loaded alone: ``load()`` + ``poll()`` at t = 0, then poll
every 0.2 ms as a scheduler would until it finished; P polls until it reports the request's
blocks free. Every landed request is checked against a digest of what P exported
(``#wrong``).

The table gives, per stage, medians over the warm requests (ms after ``load()``) of its first
start, its last end and its busy time (the sum of its ranges: a pg request's chunks give
several), the p90 of its end and how many ranges it had. Ranges without a request id
(``wait``) count for the request whose ``load`` range holds them on that thread.

    python profiling/bench_latency.py [--transport ipc|pg] [--tokens 16,4096] [--reqs 20]
        [--paths onesided,messaged] [--layers 32] [--device cpu|cuda] [--out DIR] [--corrupt]

Over ``ipc`` each size runs twice: the one-sided path (``load()`` finds the request's lease slot
and copies at once; ``poll()`` checks and reports; P frees on its next poll from D's done mark;
the notification follows 0.1 s later, off the path) and the messaged one (``TransferEngine(onesided=False)``: lease grant, copy in the worker,
notification).

Under each table, a reference measured in the same run between the same two processes, their
engines running: a bare ZeroMQ round trip (a DEALER in D, an echoing ROUTER thread in P, a
256-byte message, as the side channel's sockets are) — the least a lease grant or a
notification round trip can cost on this machine — and the grant round trip as a multiple of it.
It is measured twice: back to back, and each after ``IDLE_GAP_S`` of idleness, as the requests
are (each waits for the one before to be freed and checked): on a machine whose idle cores
sleep deeply, waking the threads costs more than the message, and only the spaced figure
shows it.

Outputs: the table on stdout and ``bench_latency.json`` (every request's ranges, the bare
round trips) under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common
from bench_transfer import digest, load_one, mappable_caches
from bench_transfer import specs as transfer_specs

from kvxfer import TransferEngine, tracing
from kvxfer.ops import gather_blocks
from kvxfer.ports import free_port_base

POLL_S = 0.0002  # D's pause between poll() calls (a model runner's step is longer)
DEADLINE_S = 60.0  # per request and per reply from P
NUM_ECHOES = 200  # bare round trips measured per size
ECHO_BYTES = 256  # about a one-request ReadReq's size on the wire
IDLE_GAP_S = 0.005  # idleness before each spaced bare round trip


# ----------------------------------------------------------------------------- bare round trip
def _polled_socket(kind: str, port: int):
    """A zmq ``kind`` socket on ``tcp://127.0.0.1:port`` (a ROUTER binds, a DEALER connects),
    no linger, and a poller watching it for input."""
    import zmq

    sock = zmq.Context.instance().socket(getattr(zmq, kind))
    sock.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{port}"
    sock.bind(addr) if kind == "ROUTER" else sock.connect(addr)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    return sock, poller


def _echo_server(port: int, ready: threading.Event, stop: threading.Event) -> None:
    """P's echoing ROUTER thread: sends back every message until ``stop``."""
    sock, poller = _polled_socket("ROUTER", port)
    ready.set()
    try:
        while not stop.is_set():
            if poller.poll(10):
                sock.send_multipart(sock.recv_multipart())
    finally:
        sock.close()


def bare_round_trips(
    port: int, n: int = NUM_ECHOES, nbytes: int = ECHO_BYTES, gap_s: float = 0.0
) -> list[float]:
    """``n`` round trips (seconds) of an ``nbytes`` message from a DEALER here to the echo
    server on ``port``, each waited for through a poller as the engine's client waits, and
    each after ``gap_s`` of sleep (0: back to back)."""
    sock, poller = _polled_socket("DEALER", port)
    payload, out = b"x" * nbytes, []
    try:
        for i in range(n + 5):  # the first 5 connect and warm up
            if gap_s:
                time.sleep(gap_s)
            t = time.perf_counter()
            sock.send(payload)
            if not poller.poll(int(DEADLINE_S * 1000)):
                raise TimeoutError(f"bare round trip {i}: no echo from P within {DEADLINE_S}s")
            sock.recv()
            if i >= 5:
                out.append(time.perf_counter() - t)
    finally:
        sock.close()
    return out


class Recorder:
    """Stands in for the ``nvtx`` module: every push and pop with its time and thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int, str | None]] = []

    def push_range(self, message=None, color=None, domain=None) -> None:
        self.calls.append((time.perf_counter(), threading.get_ident(), message))

    def pop_range(self, domain=None) -> None:
        self.calls.append((time.perf_counter(), threading.get_ident(), None))

    def ranges(self, side: str) -> list[dict]:
        """Closed ranges (a push matched with its thread's next pop):
        ``{"side", "phase", "tag", "start", "end", "thread"}``."""
        out, stacks = [], {}
        for t, tid, msg in list(self.calls):
            st = stacks.setdefault(tid, [])
            if msg is not None:
                st.append((t, msg))
                continue
            if not st:
                continue
            t0, m = st.pop()
            name, _, tag = m.partition(" ")
            phase = name.removeprefix(f"{tracing.DOMAIN}.")
            out.append({"side": side, "phase": phase, "tag": tag, "start": t0, "end": t, "thread": tid})
        return out


def _busy(switch_ms: float | None, busy: bool) -> None:
    """What a serving engine's process adds (``--busy-thread``): a thread that runs Python
    without pause, as vLLM's engine loop does while a request waits for its KV, so each of the
    engine's threads waits for the GIL whenever it wakes; ``switch_ms``: the interpreter's
    switch interval (``sys.setswitchinterval``) in this process."""
    if switch_ms is not None:
        sys.setswitchinterval(switch_ms / 1e3)
    if busy:

        def spin() -> None:
            x = 0
            while True:
                x = (x + sum(range(50))) & 0xFFFF

        threading.Thread(target=spin, name="busy-engine-loop", daemon=True).start()


def _record() -> Recorder:
    rec = Recorder()
    os.environ.pop("KVXFER_NVTX", None)
    tracing.set_enabled(True, nvtx_module=rec)
    return rec


# ----------------------------------------------------------------------------- exporter process
def exporter(args: dict, conn) -> None:
    """P: "export" (params and the digest of what they hold), "freed" (when P's poll reported
    the request's blocks free), "ranges", "stop"."""
    try:
        _exporter(args, conn)
    except BaseException as e:  # report, never hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _exporter(args: dict, conn) -> None:
    rec = _record()
    _busy(args["switch_ms"], args["busy"])
    p_spec, _ = transfer_specs(args["layers"])
    device = torch.device(args["device"])
    nb = p_spec.num_blocks_for(args["tokens"])
    shm, caches = mappable_caches(p_spec, nb, device, fill=True)
    eng = TransferEngine(
        p_spec, caches, 0, 1, "P", transport=args["transport"], port=args["port"], lease_s=60.0
    )
    eng.start()
    freed: dict[str, float] = {}
    echo_stop = threading.Event()
    ids = list(range(nb))
    conn.send(("ready", None))
    try:
        while True:
            r = eng.poll()
            t = time.perf_counter()
            for rid in r.finished_sending | r.expired:
                freed.setdefault(rid, t)
            if not conn.poll(0.0002):
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            if cmd[0] == "export":
                params = eng.export(cmd[1], ids, args["tokens"])
                conn.send(("params", params, digest(gather_blocks(caches, p_spec, ids, args["tokens"]))))
            elif cmd[0] == "freed":
                end = time.monotonic() + DEADLINE_S
                while cmd[1] not in freed and time.monotonic() < end:
                    r = eng.poll()
                    t = time.perf_counter()
                    for rid in r.finished_sending | r.expired:
                        freed.setdefault(rid, t)
                    time.sleep(POLL_S)
                conn.send(("freed", freed.get(cmd[1])))
            elif cmd[0] == "ranges":
                conn.send(("ranges", rec.ranges("P")))
            elif cmd[0] == "echo":  # a bare round trip's server, beside the engine's threads
                ready = threading.Event()
                threading.Thread(target=_echo_server, args=(cmd[1], ready, echo_stop), daemon=True).start()
                conn.send(("echo", ready.wait(DEADLINE_S)))
    finally:
        echo_stop.set()
        eng.close()
        if shm is not None:
            shm.close()


def _get(conn, kind: str, proc):
    return common.expect(conn, kind, proc, DEADLINE_S)


# ----------------------------------------------------------------------------- timeline
STAGES = (  # (side, phase, label), in path order; a phase absent on a transport is left out
    ("D", "call", "load() + poll()      D caller: validate, queue, dispatch"),
    ("D", "load", "load                 D worker: the batch, dispatch to completion"),
    ("D", "grant", "grant                D worker: lease grant round trip"),
    ("P", "serve ReadReq", "serve ReadReq        P side channel: grant (epochs, renew)"),
    ("P", "serve SendReq", "serve SendReq        P side channel: queue the pg stream"),
    ("P", "gather", "gather               P sender: cache -> wire"),
    ("P", "send", "send                 P sender: wire -> D"),
    ("D", "recv", "recv                 D worker: wire from P"),
    ("D", "scatter", "scatter              D worker: wire -> cache"),
    ("P", "status", "status               P sender: stream status to D (after every send completed)"),
    ("D", "status", "status               D worker: stream status from P"),
    ("D", "copy", "copy                 D caller (one-sided) or worker: P's cache -> D's"),
    ("D", "wait", "wait                 D worker: CUDA event polls, chunk receives"),
    ("D", "done", "done                 D caller: poll() reports it finished"),
    ("D", "notify", "notify               D notifier: round trip to P"),
    ("P", "serve Notify", "serve Notify         P side channel: count, release"),
    ("P", "freed", "freed                P caller: poll() reports the blocks free"),
)


def _stages(rid: str, t0: float, t_call: float, t_done: float, t_freed: float | None, ranges: list[dict]):
    """Stage -> (first start, last end, busy time, number of ranges), in ms after ``load()``, for
    request ``rid``: its ranges of each phase (a pg request's chunks give several), ranges
    without its id inside its ``load`` range on the same thread counted too."""
    mine = [r for r in ranges if rid in r["tag"].split("+")[0].split(" ")]
    load = next((r for r in mine if r["side"] == "D" and r["phase"] == "load"), None)
    if load is not None:
        mine += [
            r
            for r in ranges
            if r["side"] == "D" and r["thread"] == load["thread"] and r not in mine
            and load["start"] <= r["start"] and r["end"] <= load["end"] and r["phase"] in ("wait",)
        ]  # fmt: skip
    call, done = (t_call - t0) * 1e3, (t_done - t0) * 1e3
    out = {("D", "call"): (0.0, call, call, 1), ("D", "done"): (done, done, 0.0, 1)}
    if t_freed is not None:
        out[("P", "freed")] = ((t_freed - t0) * 1e3, (t_freed - t0) * 1e3, 0.0, 1)
    for r in mine:
        key = (r["side"], f"serve {r['tag'].split(' ')[0]}" if r["phase"] == "serve" else r["phase"])
        a, b = (r["start"] - t0) * 1e3, (r["end"] - t0) * 1e3
        s0, e0, busy, n = out.get(key, (a, b, 0.0, 0))
        out[key] = (min(s0, a), max(e0, b), busy + b - a, n + 1)
    return out


def _pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(a: argparse.Namespace) -> int:
    device = common.pick_device(a.device)
    rec = _record()
    _busy(a.switch_ms, a.busy_thread)
    p_spec, d_spec = transfer_specs(a.layers)
    meta = common.run_metadata(device)
    write = common.table_writer()
    rows, raw, failures = [], [], 0
    bare_runs: list[dict] = []
    paths = a.path_list if a.transport == "ipc" else ["messaged"]  # only ipc reads one-sided
    for tokens, path in [(n, q) for n in a.token_list for q in paths]:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        args = {
            "layers": a.layers,
            "device": str(device),
            "tokens": tokens,
            "port": free_port_base(1),
            "transport": a.transport,
            "busy": a.busy_thread,
            "switch_ms": a.switch_ms,
        }
        proc = ctx.Process(target=exporter, args=(args, there), daemon=True)
        proc.start()
        d_ids = list(range(d_spec.num_blocks_for(tokens)))[::-1]
        shm, caches = mappable_caches(d_spec, len(d_ids), device, fill=False)
        eng = TransferEngine(
            d_spec,
            caches,
            0,
            1,
            f"D-{tokens}",
            transport=a.transport,
            lease_s=60.0,
            onesided=path == "onesided",
        ).start()
        per: list[dict] = []
        bare: list[float] = []
        wrong = 0
        try:
            _get(here, "ready", proc)
            for i in range(a.reqs + 1):  # request 0 handshakes (and maps or pairs): left out
                rid = f"t{tokens}-r{i}"
                here.send(("export", rid))
                _, params, want = _get(here, "params", proc)
                rec.calls.clear()
                t0, t_call, t_done = load_one(eng, rid, params, d_ids)
                here.send(("freed", rid))
                t_freed = _get(here, "freed", proc)[1]
                # the notifier's range closes on P's ack (a landed one-sided load's is deferred)
                closed = time.monotonic() + (1.0 if path == "messaged" else 0.0)
                while time.monotonic() < closed and not any(
                    x["phase"] == "notify" and rid in x["tag"] for x in rec.ranges("D")
                ):
                    time.sleep(POLL_S)
                here.send(("ranges",))
                ranges = rec.ranges("D") + [x for x in _get(here, "ranges", proc)[1] if x["end"] >= t0]
                # checked once the request's path is over (the digest would compete with it)
                if a.corrupt and i == a.reqs:  # prove the check can fail: flip one landed byte
                    caches[0].view(torch.uint8).view(-1)[0].bitwise_not_()  # block 0 is in d_ids
                wrong += digest(gather_blocks(caches, d_spec, d_ids, tokens)) != want
                if i:
                    per.append(
                        {
                            "request": rid,
                            "stages": _stages(rid, t0, t_call, t_done, t_freed, ranges),
                            "ranges": ranges,
                        }
                    )
            echo_port = free_port_base(1)
            here.send(("echo", echo_port))
            if not _get(here, "echo", proc)[1]:
                raise TimeoutError("the exporter's echo server did not start")
            bare = bare_round_trips(echo_port)
            spaced = bare_round_trips(echo_port, gap_s=IDLE_GAP_S)
        finally:
            eng.close()
            if shm is not None:
                shm.close()
            with contextlib.suppress(OSError):  # P may be gone already
                here.send(("stop",))
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        failures += wrong
        bare_ms = [x * 1e3 for x in bare]
        spaced_ms = [x * 1e3 for x in spaced]
        warm_ref, idle_ref = common.idle_reference_us()
        bare_runs.append({"tokens": tokens, "path": path, "round_trips_ms": bare_ms, "spaced_round_trips_ms": spaced_ms,
                          "idle_gap_s": IDLE_GAP_S, "loop_us_warm_idle": [warm_ref, idle_ref]})  # fmt: skip
        nbytes = tokens * p_spec.bytes_per_token()
        write(
            f"# kvxfer bench_latency on {meta['device']} ({device.type}), {meta['date']}, commit {meta['git_commit']}"
        )
        write(
            f"# {a.transport}, {path} path: P tp=1 NHD block 16 -> D tp=1 HND block 32, {a.layers} layers x 8 kv "
            "heads x 128 bf16"
        )
        write(
            f"# {tokens} tokens ({nbytes} bytes), {len(per)} warm requests, one at a time; ms after load(); #wrong {wrong}"
        )
        write(f"# command: {meta['command']}")
        write(f"#{'stage':<64} {'start':>8} {'end':>8} {'busy':>8} {'p90 end':>8} {'ranges':>6} {'n':>3}")
        for side, phase, label in STAGES:
            got = [p["stages"][(side, phase)] for p in per if (side, phase) in p["stages"]]
            if not got:
                continue
            med = [statistics.median(g[k] for g in got) for k in range(4)]
            p90 = _pct([g[1] for g in got], 0.9)
            write(
                f" {label:<64} {med[0]:8.3f} {med[1]:8.3f} {med[2]:8.3f} {p90:8.3f} {med[3]:6.0f} {len(got):3d}"
            )
            rows.append(
                {"transport": a.transport, "path": path, "tokens": tokens, "bytes": nbytes, "side": side, "stage": phase,
                 "start_ms": med[0], "end_ms": med[1], "busy_ms": med[2], "p90_end_ms": p90,
                 "ranges": med[3], "n": len(got), "wrong": wrong}
            )  # fmt: skip
        grants = [p["stages"][("D", "grant")][2] for p in per if ("D", "grant") in p["stages"]]
        b50, s50 = statistics.median(bare_ms), statistics.median(spaced_ms)
        g50 = statistics.median(grants) if grants else None
        ratio = (
            f"; the grant round trip is {g50 / b50:.1f}x the first and {g50 / s50:.1f}x the second"
            if g50
            else ""
        )
        write(
            f"# reference, the same processes with their engines running: a bare zmq round trip "
            f"({ECHO_BYTES} B, D -> a ROUTER thread in P) p50 {b50:.3f} ms (p90 {_pct(bare_ms, 0.9):.3f}) "
            f"back to back, p50 {s50:.3f} ms (p90 {_pct(spaced_ms, 0.9):.3f}) each after "
            f"{IDLE_GAP_S * 1e3:.0f} ms idle, over {len(bare_ms)} each{ratio}"
        )
        write(
            f"# reference, this machine's caches: a fixed Python loop (sum(range(100))) {warm_ref:.2f} us back "
            f"to back, {idle_ref:.1f} us after 10 ms idle ({idle_ref / warm_ref:.0f}x); D waits on P between "
            "requests, so each request's steps run with the second"
        )
        write("")
        raw += [{"request": p["request"], "ranges": p["ranges"]} for p in per]
    common.write_json(
        os.path.join(a.out, "bench_latency.json"), meta, rows, requests=raw, bare_round_trips=bare_runs
    )
    write(f"# wrong requests: {failures}  {'OK' if not failures else 'WRONG'}")
    return 1 if failures else 0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, its values checked (``token_list``, ``path_list`` added)."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--transport", default="ipc", help="ipc (default) or pg")
    ap.add_argument("--tokens", default="16,4096", help="comma list of prompt lengths (default 16,4096)")
    ap.add_argument(
        "--paths",
        default="onesided,messaged",
        help="ipc: the one-sided path (load() copies when the lease slot allows), the messaged one "
        "(lease grant, copy in the worker), or both (default)",
    )
    ap.add_argument("--reqs", type=int, default=20, help="warm requests per size (default 20)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    ap.add_argument("--corrupt", action="store_true", help="flip a landed byte (tests the #wrong check)")
    ap.add_argument(
        "--busy-thread",
        action="store_true",
        help="in P and D, a thread running Python without pause (a serving engine's loop)",
    )
    ap.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval in P and D (ms)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    a = ap.parse_args(argv)
    if a.transport not in ("ipc", "pg"):
        ap.error(f"--transport: {a.transport!r} is not ipc or pg")
    a.path_list = [x for x in a.paths.split(",") if x]
    if not a.path_list or any(x not in ("onesided", "messaged") for x in a.path_list):
        ap.error(f"--paths: {a.paths!r} is not a list of onesided, messaged")
    try:
        a.token_list = [int(x) for x in a.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: {a.tokens!r} is not a comma list of token counts")
    if not all(n >= 1 for n in a.token_list):
        ap.error(f"--tokens: {a.tokens!r}: each count must be >= 1")
    return a


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
