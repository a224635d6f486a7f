"""Host cost of one side-channel round trip, with the exporter in another process.

``bench_engine.py`` answers the loader's messages in its own thread (its ``Loopback``): it
leaves out the socket hop, and with it what kvxfer's own client and server do around each
message. Here a loader thread sends what one messaged request sends (a lease request for a
4K-token load, answered by a 256-block grant, then a notification, answered by an
acknowledgement) through :class:`~kvxfer.control.ControlClient` to a
:class:`~kvxfer.control.ControlServer` in a second process, whose handler returns canned
replies. Reported per message: the CPU time the loader's thread spends in ``call()`` (its
thread clock: sleeping for the reply costs nothing, waking up does), the serving thread's CPU
per message taken, and the round trip's wall time. Beside them, the same two round trips with
bare pyzmq sockets (one DEALER, one ROUTER, the same frames and payloads, blocking receives):
what zmq itself costs on this machine (the server's wake-up from its poll counted on both
sides), the floor for kvxfer's side channel.

``--trees A B``: each tree's ``kvxfer`` in its own child process, rounds alternating the trees
(and which goes first), so both see the same machine within seconds; the ratio to quote is the
median over rounds of B / A.

    python profiling/bench_side_channel.py [--trees /tmp/base .] [--rounds 6] [--calls 1500]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EPOCH_BYTES = 256 * 8  # a 4K-token load's 256 blocks' epochs, int64


def _messages(C):
    """(lease request, its grant, notification, acknowledgement), as one 4K-token load's."""
    rid, token = "req-0001", "0" * 32
    return (
        C.ReadReq("D", 0, 1, [rid], [token], digests=[bytes(32)]),
        C.ReadReply(ok=[rid], epochs=[bytes(EPOCH_BYTES)], failed={}, incarnation="p-1", layers=[]),
        C.Notify("D", 0, 1, [rid], [], [token]),
        C.Ack(failed={}),
    )


def _serve_kvxfer(root: str, port_q, stop, out_q) -> None:
    sys.path.insert(0, root)
    import zmq

    from kvxfer import control as C

    _, grant, _, ack = _messages(C)
    srv = C.ControlServer(zmq.Context.instance(), "127.0.0.1", 0)
    port_q.put(srv.port)

    def handle(msg):
        return grant if type(msg) is C.ReadReq else ack

    n = cpu = 0
    while not stop.is_set():
        t = time.thread_time_ns()
        k = srv.serve_once(handle, 20)
        if k:
            cpu += time.thread_time_ns() - t
            n += k
    out_q.put((n, cpu))


def _serve_raw(port_q, stop, out_q) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    grant, ack = bytes(EPOCH_BYTES + 60), bytes(8)
    n = cpu = 0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        t = time.thread_time_ns()  # the wake-up counts, as in serve_once
        if poller.poll(20):
            ident, mid, payload = sock.recv_multipart()
            sock.send_multipart([ident, mid, grant if len(payload) > 100 else ack])
            cpu += time.thread_time_ns() - t
            n += 1
    out_q.put((n, cpu))


def _with_server(target, args, body) -> tuple:
    """Run ``target`` (a server) in a spawned process, ``body(port)`` here; returns (what
    ``body`` returned, the server's (messages, CPU ns)). The server is stopped and joined with
    a bound, killed if it does not stop."""
    ctx = mp.get_context("spawn")
    port_q, out_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=target, args=(*args, port_q, stop, out_q), daemon=True)
    p.start()
    try:
        port = port_q.get(timeout=60)
        got = body(port)
        stop.set()
        served = out_q.get(timeout=30)
    finally:
        stop.set()
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)
    return got, served


def _timed(calls: int, one) -> dict:
    """CPU (this thread) and wall per call of ``one(i)``, medians in us, after 200 warm-up calls."""
    cpu, wall = [], []
    for i in range(calls + 200):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        one(i)
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        if i >= 200:
            cpu.append((c1 - c0) / 1e3)
            wall.append((t1 - t0) / 1e3)
    return {"cpu_us": statistics.median(cpu), "wall_us": statistics.median(wall)}


def measure(root: str, calls: int) -> dict:
    """One tree's figures: the loader's CPU per call (grant, notify), the server's CPU per
    message, the wall per round trip; and bare pyzmq's same figures."""
    sys.path.insert(0, root)
    import zmq

    from kvxfer import control as C

    req, grant, note, _ = _messages(C)

    def kvxfer_body(port):
        addr = f"tcp://127.0.0.1:{port}"
        client = C.ControlClient(zmq.Context.instance())
        try:
            got = client.call(addr, req, 10.0)
            assert type(got) is C.ReadReply and got.epochs == grant.epochs, "the grant came back altered"
            return {
                "grant": _timed(calls, lambda i: client.call(addr, req, 10.0)),
                "notify": _timed(calls, lambda i: client.call(addr, note, 10.0)),
            }
        finally:
            client.close()

    def raw_body(port):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        payloads = {"grant": C.encode(req), "notify": C.encode(note)}
        try:

            def one(kind):
                def call(i):
                    sock.send_multipart([struct.pack("<Q", i), payloads[kind]])
                    sock.recv_multipart()

                return call

            return {k: _timed(calls, one(k)) for k in payloads}
        finally:
            sock.close(0)

    got, (n, cpu) = _with_server(_serve_kvxfer, (root,), kvxfer_body)
    raw, (rn, rcpu) = _with_server(_serve_raw, (), raw_body)
    return {
        "kvxfer": {**got, "server_cpu_us": cpu / max(n, 1) / 1e3},
        "zmq": {**raw, "server_cpu_us": rcpu / max(rn, 1) / 1e3},
    }


def _child(root: str, calls: int) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", root, "--calls", str(calls)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _medians(runs: list[dict]) -> dict:
    """Each figure's median over ``runs`` (dicts of one shape, figures at the leaves)."""
    return {
        k: _medians([r[k] for r in runs]) if isinstance(v, dict) else statistics.median(r[k] for r in runs)
        for k, v in runs[0].items()
    }


def _ratios(work: dict, base: dict) -> dict:
    """``work`` / ``base``, figure by figure (dicts of one shape)."""
    return {k: _ratios(v, base[k]) if isinstance(v, dict) else v / base[k] for k, v in work.items()}


def _row(name: str, r: dict) -> str:
    return (
        f"{name:28s} grant: loader cpu {r['grant']['cpu_us']:6.1f} us, wall {r['grant']['wall_us']:6.1f} us; "
        f"notify: loader cpu {r['notify']['cpu_us']:6.1f} us; server cpu per message {r['server_cpu_us']:6.1f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="+", default=[os.path.dirname(HERE)])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(os.path.abspath(a.child), a.calls)))
        return
    trees = [os.path.abspath(t) for t in a.trees]
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(a.rounds):
        for t in trees if r % 2 == 0 else trees[::-1]:
            runs[t].append(_child(t, a.calls))
    summary = {t: _medians(runs[t]) for t in trees}
    for t, med in summary.items():
        print(_row(f"kvxfer ({os.path.basename(t) or t})", med["kvxfer"]))
        print(_row("  bare pyzmq, same run", med["zmq"]))
    out = {"bench": "side_channel", "rounds": a.rounds, "calls": a.calls, "trees": summary}
    if len(trees) == 2:
        base, work = trees
        ratios = _medians([_ratios(w["kvxfer"], b["kvxfer"]) for b, w in zip(runs[base], runs[work])])
        out["ratio_b_over_a"] = ratios
        g, n = ratios["grant"], ratios["notify"]
        print(
            f"median per-round ratio, second tree / first: grant cpu {g['cpu_us']:.2f}x, wall "
            f"{g['wall_us']:.2f}x; notify cpu {n['cpu_us']:.2f}x; server cpu {ratios['server_cpu_us']:.2f}x"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
