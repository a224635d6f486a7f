"""A stranger writes random words into every field of an exporter's live lease-slot table (from
its own process, as any process of the same user can) while an honest P and D run one-sided
(and, where the table turns them away, messaged) loads. Asserted: nothing crashes, no exception
leaves either poll(), every load is reported once and every export once, no load reported done
holds a wrong byte (P overwrites a block the moment it releases it), and P holds no block at
the end. D's table reads run natively and in Python (``KVXFER_NATIVE_CTL=0``'s steps)."""

from __future__ import annotations

import random
import time

import pytest

from .engine_payload import check, fill
from .engine_procs import _context, _entry
from .hostile_procs import table_writer
from .onesided_helpers import F16, Ranks, python_slot_reads, warm


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_random_words_in_every_table_field_while_honest_loads_run(native, capsys):
    rng = random.Random(11 + native)
    num, in_flight, seconds = 160, 8, 60.0
    p = Ranks(F16, 1, "P", nb=96, lease_s=5.0)
    d = None
    proc = None
    try:
        d = Ranks(F16, 1, "D", nb=96, timeout_s=1.0)
        warm(p, d)
        if not native:
            python_slot_reads(d)
        ipc = p[0]._transports["ipc"]
        ctx = _context()
        out_q, q_stop = ctx.Queue(), ctx.Queue()
        args = (ipc.slot_segment.name, ipc.entry["slot_words"], 5, seconds, q_stop)
        proc = ctx.Process(target=_entry, args=(table_writer, args, out_q, "H"), daemon=True)
        proc.start()
        p_free, d_free = list(range(1, 96)), list(range(1, 96))
        p_held: dict[str, list[int]] = {}
        d_held: dict[str, tuple[list[int], int, int]] = {}
        sent: dict[str, int] = {}  # P's reports per export
        got: dict[str, list[str]] = {}  # D's reports per load
        wrong: list[str] = []
        i = 0
        end = time.monotonic() + seconds
        while (i < num or p_held or d_held) and time.monotonic() < end:
            while i < num and len(d_held) < in_flight:
                n = rng.randint(1, 40)
                need = F16.num_blocks_for(n)
                if len(p_free) < need or len(d_free) < need:
                    break
                rng.shuffle(p_free)
                s_ids, d_ids = [p_free.pop() for _ in range(need)], [d_free.pop() for _ in range(need)]
                rid = f"q{i}"
                fill(p.caches(0), F16, 0, 1, s_ids, n, seed=100 + i)
                prm = p[0].export(rid, s_ids, n)
                p_held[rid] = s_ids
                d_held[rid] = (d_ids, n, 100 + i)
                d[0].load(rid, prm, d_ids)
                i += 1
            r = d[0].poll()
            for rid in r.finished_recving:
                d_ids, n, seed = d_held[rid]
                if not check(d.caches(0), F16, 0, 1, d_ids, n, seed):  # now: nothing may change it
                    wrong.append(rid)
            for rid in [*r.finished_recving, *r.failed]:
                got.setdefault(rid, []).append("done" if rid in r.finished_recving else r.errors[rid])
                if rid in d_held:
                    d_free.extend(d_held.pop(rid)[0])
            r = p[0].poll()
            for rid in r.finished_sending | r.expired:
                sent[rid] = sent.get(rid, 0) + 1
                if rid in p_held:
                    ids = p_held.pop(rid)
                    fill(p.caches(0), F16, 0, 1, ids, len(ids) * F16.block_size, seed=7)  # reused at once
                    p_free.extend(ids)
            time.sleep(0.001)
        q_stop.put(True)
        _, status, wrote = out_q.get(timeout=30)
        assert status == "ok", wrote
        stats = p[0].stats()
        figures = {
            "native": native,
            "loads": i,
            "done": sum(v == ["done"] for v in got.values()),
            "failed": sum(v != ["done"] for v in got.values()),
            "why": sorted({v[0][:60] for v in got.values() if v != ["done"]}),
            "onesided": d.onesided()[0],
            "fallbacks": d[0].stats()["onesided"]["fallbacks"],
            "words_written": sum(wrote.values()),
        }
        with capsys.disabled():
            print(f"\ntable fuzz: {figures}")
        assert i == num and not p_held and not d_held, (i, sorted(p_held), sorted(d_held))
        assert not wrong, wrong
        assert set(got) == set(sent) == {f"q{k}" for k in range(num)}
        assert all(len(v) == 1 for v in got.values()), {k: v for k, v in got.items() if len(v) > 1}
        assert all(c == 1 for c in sent.values()), {k: c for k, c in sent.items() if c > 1}
        assert stats["exports_live"] == 0 and stats["blocks_held"] == 0, stats
        assert figures["words_written"] > 1000 and figures["done"] > 0 and figures["onesided"] > 0, figures
    finally:
        if proc is not None:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        p.close()
        if d is not None:
            d.close()
