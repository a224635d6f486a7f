"""What a thread holding the GIL costs a message hop through another thread of its process.

    python profiling/bench_gil_hop.py [--rounds 200] [--intervals 5,1,0.5,0.2]

A vLLM worker (and, at TP 1, its engine core) runs a Python loop that holds the GIL between
steps; kvxfer's engine threads answer and send messages beside it. This reproduces that: one
thread spins in Python, another answers a zmq REQ/REP round trip from a second process; the
round trip's median and p90 per GIL switch interval (``sys.setswitchinterval``), the intervals
alternating round by round so that the machine's drift hits them alike. Also without the
spinning thread, the floor. In isolation a shorter interval cuts the hop several-fold; served
behind vLLM it did not shorten kvxfer's per-request transfer
(``profiling/results/2026-11-28-cpu-vllm-gil/README.md``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import zmq

_CLIENT = """
import sys, time, zmq
c = zmq.Context().socket(zmq.REQ)
c.connect(sys.argv[1])
for line in sys.stdin:
    n = int(line)
    out = []
    for _ in range(n):
        t = time.perf_counter(); c.send(b"x"); c.recv(); out.append(time.perf_counter() - t)
        time.sleep(0.002)
    print(" ".join(f"{v:.9f}" for v in out), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--intervals", default="5,1,0.5,0.2", help="ms")
    a = ap.parse_args()
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    spin = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if rep.poll(50):
                rep.send(rep.recv())

    def busy() -> None:
        while not stop.is_set():
            if spin.is_set():
                sum(range(200))  # Python bytecode: holds the GIL but for forced switches
            else:
                time.sleep(0.001)

    threads = [threading.Thread(target=serve, daemon=True), threading.Thread(target=busy, daemon=True)]
    for t in threads:
        t.start()
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, f"tcp://127.0.0.1:{port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    cases = [("no busy thread", 5.0, False)] + [
        (f"busy, {v} ms", float(v), True) for v in a.intervals.split(",")
    ]
    got: dict[str, list[float]] = {c[0]: [] for c in cases}
    old = sys.getswitchinterval()
    try:
        for r in range(a.rounds):
            for name, ms, busy_on in cases if r % 2 == 0 else cases[::-1]:
                sys.setswitchinterval(ms / 1000.0)
                spin.set() if busy_on else spin.clear()
                client.stdin.write(f"{a.per_round}\n")
                client.stdin.flush()
                got[name] += [float(v) * 1e3 for v in client.stdout.readline().split()]
    finally:
        spin.clear()
        sys.setswitchinterval(old)
        stop.set()
        client.stdin.close()
        client.wait(timeout=10)
    rows = {}
    print(f"{'case':<18} {'median ms':>10} {'p90 ms':>8}")
    for name, v in got.items():
        v.sort()
        rows[name] = {"median_ms": round(v[len(v) // 2], 3), "p90_ms": round(v[int(len(v) * 0.9)], 3)}
        print(f"{name:<18} {rows[name]['median_ms']:>10.3f} {rows[name]['p90_ms']:>8.3f}")
    print(json.dumps({"bench": "gil_hop", "rounds": a.rounds, "per_round": a.per_round, "rows": rows}))


if __name__ == "__main__":
    main()
