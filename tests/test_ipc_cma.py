"""Cross-memory attach (kvxfer.transports.ipc.cma): plain CPU caches read by the ipc transport.

The mirrors hold exactly the blocks a fetch named, nothing else; a probe that does not match, a
pid that is gone and an exporter that died between the lookup and the copy are refused by
name; between processes, the messaged and the one-sided path land the exporter's bytes."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec
from kvxfer.transports.ipc import cma

from .engine_payload import check, fill, poison, untouched
from .engine_procs import _context, free_port_base, run_procs

pytestmark = pytest.mark.skipif(cma.available() != "", reason=f"cross-memory attach: {cma.available()}")

SPEC = KVCacheSpec(3, 4, 24, 16, torch.float16)
HND = KVCacheSpec(3, 4, 24, 8, torch.bfloat16, layout="HND")
MLA = KVCacheSpec(2, 1, 40, 16, torch.float16, use_mla=True)


def _caches(spec: KVCacheSpec, nb: int):
    return [torch.randn(spec.cache_shape(nb, 1)).to(spec.dtype) for _ in range(spec.num_layers)]


def _blocks(t: torch.Tensor, spec: KVCacheSpec, ids) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    return t[ids] if spec.use_mla else t[:, ids]


@pytest.mark.parametrize("spec", [SPEC, HND, MLA], ids=["NHD", "HND", "MLA"])
def test_fetch_fills_exactly_the_named_blocks(spec):
    nb = 40
    src = _caches(spec, nb)
    desc = cma.describe(src)
    r = cma.Remote(desc)
    try:
        rng = random.Random(1)
        for _ in range(4):
            ids = [*rng.sample(range(nb), 7), 3, 3]  # repeats allowed
            layers = sorted(rng.sample(range(spec.num_layers), 2))
            r.fetch(np.array(ids), layers)
            for layer in range(spec.num_layers):
                m = r.caches[layer]
                got, want = _blocks(m, spec, sorted(set(ids))), _blocks(src[layer], spec, sorted(set(ids)))
                if layer in layers:
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                else:
                    assert not got.view(torch.uint8).any(), "a layer not named was read"
            others = sorted(set(range(nb)) - set(ids))
            for layer in layers:  # blocks not named stay as the mapping made them: zero pages
                assert not _blocks(r.caches[layer], spec, others).view(torch.uint8).any()
            r.drop()
            assert all(not m.view(torch.uint8).any() for m in r.caches), "drop left pages behind"
        assert r.num_fetches == 4
    finally:
        r.close()


@pytest.mark.parametrize("spec", [SPEC, HND, MLA, KVCacheSpec(2, 2, 8, 12, torch.float8_e4m3fn)],
                         ids=["NHD", "HND", "MLA", "NHD-fp8"])  # fmt: skip
@pytest.mark.parametrize("last_rows", [None, 1, 5])
def test_direct_read_lands_exactly_the_named_rows(spec, last_rows):
    """Remote.read_direct: blocks src[i] of the named layers land in blocks dst[i] of this
    rank's caches, the last pair's first ``last_rows`` rows only; every other byte (other
    layers, other blocks, the last block's later rows) keeps its poison."""
    nb, bs = 40, spec.block_size
    last_rows = bs if last_rows is None else last_rows
    src = _caches(spec, nb)
    dst = [torch.empty(spec.cache_shape(nb + 3, 1), dtype=spec.dtype) for _ in src]
    for c in dst:
        c.view(torch.uint8).fill_(0xA5)
    want = [c.clone() for c in dst]
    r = cma.Remote(cma.describe(src))
    try:
        token_dim = 1 if spec.use_mla else (2 if spec.layout.value == "NHD" else 3)
        d = r.direct(dst, token_dim)
        assert d is not None
        s_ids, d_ids = np.array([7, 2, 31, 11]), np.array([40, 0, 13, 25])
        layers = np.array([0, spec.num_layers - 1])
        got = r.read_direct(d, layers, s_ids, d_ids, last_rows)
        row_bytes = spec.bytes_per_token() // spec.num_layers
        assert got == len(layers) * (3 * bs + last_rows) * row_bytes
        for layer in layers:
            for k, (si, di) in enumerate(zip(s_ids, d_ids)):
                rows = bs if k < 3 else last_rows
                if spec.use_mla:
                    want[layer][di, :rows] = src[layer][si, :rows]
                elif spec.layout.value == "NHD":
                    want[layer][:, di, :rows] = src[layer][:, si, :rows]
                else:
                    want[layer][:, di, :, :rows] = src[layer][:, si, :, :rows]
        for a, b in zip(dst, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    finally:
        r.close()


def test_direct_read_needs_caches_laid_out_alike():
    src = _caches(SPEC, 40)
    r = cma.Remote(cma.describe(src))
    try:
        assert r.direct(_caches(SPEC, 9), 2) is not None  # another block count: fine
        assert r.direct(_caches(HND, 40), 2) is None  # another layout within the block
        assert r.direct([c.to(torch.bfloat16) for c in _caches(SPEC, 40)], 2) is None
        assert r.direct(_caches(SPEC, 40)[:2], 2) is None  # fewer layers
        assert r.direct([c[:, :, :, :2] for c in _caches(SPEC, 40)], 2) is None  # other heads
    finally:
        r.close()


def test_merge_joins_touching_and_overlapping_ranges():
    rng = np.random.default_rng(0)
    for _ in range(50):
        span = int(rng.integers(1, 64))
        starts = rng.integers(0, 400, size=int(rng.integers(1, 30))).astype(np.int64)
        s, n = cma._merge(starts, span)
        covered = np.zeros(500, dtype=bool)
        for a in starts:
            covered[a : a + span] = True
        got = np.zeros(500, dtype=bool)
        for a, k in zip(s, n):
            assert not got[a : a + k].any(), "merged ranges overlap"
            got[a : a + k] = True
        assert np.array_equal(covered, got)
        assert np.all(s[1:] > s[:-1] + n[:-1] - 1)  # separate runs do not touch


def test_a_probe_that_does_not_match_is_refused():
    desc = cma.describe(_caches(SPEC, 4))
    assert cma.probe(desc) == ""  # what the loader asks at the handshake: nothing kept open
    desc["probe"] = "00" * 16
    assert "not the exporter" in cma.probe(desc)
    with pytest.raises(OSError, match="not the exporter"):
        cma.Remote(desc)


def test_a_pid_that_is_gone_is_refused():
    ctx = _context()
    p = ctx.Process(target=os.getpid)
    p.start()
    p.join(timeout=30)
    desc = cma.describe(_caches(SPEC, 4))
    desc["pid"] = p.pid  # exited and reaped
    with pytest.raises(OSError):
        cma.Remote(desc)


def test_ids_out_of_range_are_refused_before_a_read():
    r = cma.Remote(cma.describe(_caches(SPEC, 4)))
    try:
        with pytest.raises(ValueError, match="out of"):
            r.fetch(np.array([1, 4]))
        assert r.num_fetches == 0
    finally:
        r.close()


def test_turned_off_by_env(monkeypatch):
    monkeypatch.setenv("KVXFER_IPC_CMA", "0")
    assert "KVXFER_IPC_CMA=0" in cma.available()
    assert cma.describe(_caches(SPEC, 4)) is None
    with pytest.raises(OSError, match="KVXFER_IPC_CMA=0"):
        cma.Remote({"pid": os.getpid()})


# --------------------------------------------------------------------------- between processes
def _exporter(sc: dict, q_params, q_ctl) -> dict:
    from kvxfer import TransferEngine

    spec = KVCacheSpec.from_dict(sc["src_spec"])
    caches = [torch.empty(spec.cache_shape(64, 1), dtype=spec.dtype) for _ in range(spec.num_layers)]
    poison(caches)
    eng = TransferEngine(spec, caches, 0, 1, "P", port=sc["port"], lease_s=30.0).start()
    released: set[str] = set()
    want: set[str] = set()
    for rnd in sc["rounds"]:
        batch = []
        for rid, n, seed, ids in rnd:
            fill(caches, spec, 0, 1, ids, n, seed)
            batch.append(eng.export(rid, ids, n))
            want.add(rid)
        q_params.put((os.getpid(), batch))
        msg = q_ctl.get(timeout=30)  # "next" round, "die" now, or "end"
        if msg == "die":
            os._exit(0)
    end = time.monotonic() + 20
    while released != want and time.monotonic() < end:
        r = eng.poll()
        released |= r.finished_sending | r.expired
        time.sleep(0.005)
    stats = eng.stats()
    eng.close()
    return {"released": sorted(released), "blocks_held": stats["blocks_held"]}


def _loader(sc: dict, q_params, q_ctl) -> dict:
    from kvxfer import TransferEngine

    spec = KVCacheSpec.from_dict(sc["dst_spec"])
    caches = [torch.empty(spec.cache_shape(64, 1), dtype=spec.dtype) for _ in range(spec.num_layers)]
    poison(caches)
    eng = TransferEngine(spec, caches, 0, 1, "D", lease_s=30.0, timeout_s=5.0).start()
    out: dict = {"ok": {}, "failed": {}}
    used: set[int] = set()
    tails: dict[int, int] = {}
    for k, rnd in enumerate(sc["rounds"]):
        pid, params = q_params.get(timeout=30)
        if sc.get("kill_before") == k:  # P exits now; D loads after it is gone
            q_ctl.put("die")
            fd = os.pidfd_open(pid)
            end = time.monotonic() + 20
            while time.monotonic() < end and not __import__("select").select([fd], [], [], 0.05)[0]:
                pass
            os.close(fd)
        for p, (rid, _n, _seed, _ids) in zip(params, rnd):
            eng.load(rid, p, sc["dst_ids"][rid])
        want = {r[0] for r in rnd}
        got: set[str] = set()
        end = time.monotonic() + 20
        while got != want and time.monotonic() < end:
            r = eng.poll()
            for rid in r.finished_recving:
                n, seed = next((x[1], x[2]) for x in rnd if x[0] == rid)
                ids = sc["dst_ids"][rid]
                out["ok"][rid] = check(caches, spec, 0, 1, ids, n, seed)
                used |= set(ids)
                tails[ids[-1]] = n - (len(ids) - 1) * spec.block_size
            for rid in r.failed:
                out["failed"][rid] = r.errors.get(rid, "?")
            got |= r.finished_recving | set(r.failed)
            time.sleep(0.002)
        if sc.get("kill_before") != k:
            q_ctl.put("next" if k + 1 < len(sc["rounds"]) else "end")
    out["untouched"] = untouched(caches, spec, used, tails)
    s = eng.stats()
    out["transports"], out["reasons"], out["onesided"] = (
        s["transports"],
        s["transport_reasons"],
        s["onesided"],
    )
    eng.close()
    return out


def _scenario(src: KVCacheSpec, dst: KVCacheSpec, rounds_lengths, **kw) -> dict:
    rng = random.Random(7)
    src_free, dst_free = list(range(64)), list(range(64))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    rounds, dst_ids, i = [], {}, 0
    for lengths in rounds_lengths:
        rnd = []
        for n in lengths:
            rid = f"r{i}"
            rnd.append((rid, n, 300 + i, [src_free.pop() for _ in range(src.num_blocks_for(n))]))
            dst_ids[rid] = [dst_free.pop() for _ in range(dst.num_blocks_for(n))]
            i += 1
        rounds.append(rnd)
    sc = {"src_spec": src.to_dict(), "dst_spec": dst.to_dict(), "rounds": rounds, "dst_ids": dst_ids}
    sc["port"] = free_port_base(1)
    sc.update(kw)
    return sc


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (SPEC, KVCacheSpec(3, 4, 24, 8, torch.float16, layout="HND")),
        (
            KVCacheSpec(2, 2, 16, 8, torch.float8_e4m3fn, layout="HND"),
            KVCacheSpec(2, 2, 16, 12, torch.float8_e4m3fn),
        ),
        (MLA, KVCacheSpec(2, 1, 40, 32, torch.float16, use_mla=True)),
        (SPEC, SPEC),
        (HND, HND),
        (MLA, MLA),
        (KVCacheSpec(2, 2, 16, 8, torch.float8_e4m3fn), KVCacheSpec(2, 2, 16, 8, torch.float8_e4m3fn)),
    ],
    ids=[
        "NHD16-HND8-fp16",
        "HND8-NHD12-fp8",
        "MLA16-MLA32",
        "NHD-alike",
        "HND-alike",
        "MLA-alike",
        "fp8-alike",
    ],
)
def test_plain_caches_between_processes_messaged_then_one_sided(src, dst):
    """Round 1 handshakes and maps P (messaged); round 2 reads one-sided: from the mirrors, or
    straight into D's caches where both are laid out alike. Every request byte-exact (partial
    last blocks: their later rows keep D's poison), nothing else written, P frees every block."""
    sc = _scenario(src, dst, [[37], [1, 16, 45, 100]])
    res = run_procs(
        {"P": (_exporter, (sc, "@queue:p", "@queue:c")), "D": (_loader, (sc, "@queue:p", "@queue:c"))}
    )
    d, p = res["D"], res["P"]
    assert not d["failed"], d["failed"]
    assert d["ok"] == {rid: True for rnd in sc["rounds"] for rid, *_ in rnd}
    assert d["untouched"]
    assert d["transports"] == {"P": "ipc"} and d["reasons"]["P"] == "ipc: cross-memory attach on one host"
    assert d["onesided"]["loads"] >= 3, d["onesided"]  # round 2 (one may still find its slot not ready)
    alike = src == dst
    assert (d["onesided"]["direct"] == d["onesided"]["loads"]) if alike else d["onesided"]["direct"] == 0
    assert p["blocks_held"] == 0 and len(p["released"]) == 5


def test_exporter_gone_before_the_read_fails_the_load_by_name():
    """P exits after exporting round 2; D's loads of it fail (not delivered, D unharmed)."""
    sc = _scenario(SPEC, SPEC, [[20], [33, 5]], kill_before=1)
    res = run_procs(
        {"P": (_exporter, (sc, "@queue:p", "@queue:c")), "D": (_loader, (sc, "@queue:p", "@queue:c"))}
    )
    d = res["D"]
    assert res["P"] == ("died", 0)
    assert d["ok"] == {"r0": True}
    assert set(d["failed"]) == {"r1", "r2"}, d
    for why in d["failed"].values():
        assert any(k in why for k in ("cma", "exited", "refused", "gone", "heartbeat", "closed")), why
    assert d["untouched"]


def test_an_absurd_description_is_refused_before_any_mirror():
    desc = cma.describe(_caches(SPEC, 4))
    with pytest.raises(ValueError, match="bytes"):
        cma.Remote({**desc, "shape": [2, 1 << 40, 16, 4, 24]})
    with pytest.raises(ValueError, match="layers"):
        cma.Remote({**desc, "addrs": desc["addrs"] * 2000})
