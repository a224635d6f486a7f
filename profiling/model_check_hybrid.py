"""Hybrid models' caches through kvxfer's TransferEngine: every group (GDN or Mamba2 state, full
attention, sliding window) of a transformers model prefilled on P, laid out as vLLM-like pages
at P's TP, moved by P's and D's engines (``ipc``, all in one process) into D's pages at another
TP, attention layout, block size, conv layout and GDN SSM order, and D's next-token
log-probabilities set against a plain run's.

Models (tiny, random weights, fp32, CPU; ``docs/research/vllm-hybrid.md`` §5): Qwen3-Next (Gated
DeltaNet + full attention), GraniteMoeHybrid (Mamba2 with one group, replicated under TP, +
full attention) and Gemma-3 (sliding window + full attention). Each runs P TP 2 -> D TP 1 and
P TP 1 -> D TP 2; P: HND attention, SD conv state, GDN SSM ``[h, V, K]`` (as on CUDA); D: NHD,
DS, ``[h, K, V]`` (as vLLM's CPU backend).

Each engine rank holds one byte buffer, layer-outer as vLLM 0.32 places a hybrid model's cache
(``KVCacheTensor``): every group's ``j``-th layer shares region ``j`` (uint8 ``[blocks, page]``),
one page per block, one block pool for all groups (block 0 the null block). As vLLM does, the
attention block size is raised until one block of one layer holds a state layer's conv and SSM
state: the smallest multiple of 8 tokens (P) or 6 (D) that does (Qwen3-Next 32 / 36, Granite
40 or 48 / 42, Gemma-3 8 / 6), and a state page is one attention block. Every engine layer's
entry of ``caches`` is its region's attention view, ``[2, B, H, N, d]`` over ``[B, 2, H, N, d]``
pages (HND) or ``[2, B, N, H, d]`` over ``[B, 2, N, H, d]`` (NHD); a state layer's page holds
its conv state, then its SSM state, then padding. The engines' groups: full attention, the
sliding window (``AttentionGroup(window=w)``), the state layers (``StateGroup`` with the
``StateSpec`` at the engine's TP and layouts). One request: P's engines export the block lists
``[full, sliding (the null block where the window has passed), [state block]]`` for the
prompt's tokens and D's engines load them into theirs: the state group crosses TP and layouts
through the ipc transport's re-sharding, the attention groups through the planner; a sliding
group moves from the start of the later of the two sides' blocks holding its window's first
token (``docs/DESIGN.md``, hybrid models).

The N - 1 flow (``docs/INTEGRATION.md`` §4a): P prefills the N prompt tokens and hands over
the state after them; D computes the next token (the plain run's argmax) itself from the moved
cache, as D computes the last of N + 1 prompt tokens.

P's pages are written from the HF cache, and D's read back into a fresh HF cache, by plain
indexing written beside this script (``hybrid_pages.py``; vLLM's sharding: each conv part sliced
by head or group per rank, replicated when ``n_groups < tp``), independent of kvxfer's index
math. P's other bytes (the null block, the sliding tokens HF no longer holds, page padding) are
garbage, D's poison. The checks, per model and direction: D's buffers byte-equal to the HF cache
written straight into D's layout plus the rows before the window the engine carries from P's
blocks (P's garbage), every other byte poison; P's buffers untouched and P's engines holding no
block once D has loaded; replicas on D's ranks equal; the bytes D's engines count equal to what
the groups need; D's next-token log-probabilities within ``--atol`` (1e-4) of the plain run of
prompt plus that token with the same argmax. Mutations (after the byte check): one layer's conv
state x 1.01, its SSM state x 1.01, one in-window block of a sliding layer x 1.01: each must
fail the log-probability check.

    python profiling/model_check_hybrid.py [--models qwen3_next,granite,gemma3] [--tokens 101]

Prints the figures (bytes moved per request against moving every block of it whole) and one
JSON line; exits 0 when every check held and every mutation failed it. Needs ``transformers``
(the ``test`` extra brings it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from hybrid_pages import GARBAGE, HEAD_DIM, KV_HEADS, POISON, Model, Pages, window_first

from kvxfer import Layout, TransferEngine
from kvxfer.groups import NULL_BLOCK
from kvxfer.ports import free_port_base

VOCAB = 128
KEY = "model-check-hybrid"


# ------------------------------------------------------------------------------------ models
def model_and_config(name: str):
    """(transformers config, :class:`Model`). Weights are spread wider than transformers' default
    (``initializer_range``), so a 1 % change of one state moves the log-probabilities past the
    tolerance (measured with 37 tokens: at 0.02 Granite's SSM x 1.01 moved them by < 1e-5)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=256)  # fmt: skip
    if name == "qwen3_next":
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(
            num_hidden_layers=4, head_dim=HEAD_DIM, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            initializer_range=0.1, **common,
        )  # fmt: skip
        return cfg, Model(name, full=(3,), state=(0, 1, 2), parts=((2, 16, False), (2, 16, False), (4, 24, False)),
                          ssm_heads=4, gdn=True)  # fmt: skip
    if name == "granite":
        from transformers import GraniteMoeHybridConfig

        cfg = GraniteMoeHybridConfig(
            num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=8, mamba_n_groups=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
            position_embedding_type="rope", initializer_range=0.2, **common,
        )  # fmt: skip
        # x: 8 heads of 128/8 = 16; B, C: 1 group of d_state 16 (replicated under TP)
        return cfg, Model(name, full=(1, 3), state=(0, 2), parts=((8, 16, False), (1, 16, True), (1, 16, True)),
                          ssm_heads=8)  # fmt: skip
    if name == "gemma3":
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(num_hidden_layers=6, head_dim=HEAD_DIM, sliding_window=16, initializer_range=0.1,
                               **common)  # fmt: skip
        return cfg, Model(name, full=(5,), sliding=(0, 1, 2, 3, 4), window=16)
    raise ValueError(f"--models: unknown model {name!r} (qwen3_next, granite, gemma3)")


# ------------------------------------------------------------------------------ HF's cache
def extract(cache) -> list[dict]:
    """Per layer: ``k``/``v`` ``[1, H, n, d]`` (sliding: the last window - 1 tokens), ``conv``
    ``[1, C, k]`` and ``rec`` (HF order) for state layers."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    out = []
    for layer in cache.layers:
        e = {}
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            e["k"], e["v"] = layer.keys.clone(), layer.values.clone()
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            e["conv"], e["rec"] = layer.conv_states[0].clone(), layer.recurrent_states[0].clone()
            e["ksz"] = layer.conv_kernel_size[0]
        out.append(e)
    return out


def inject(model, ex: list[dict], num_tokens: int):
    """A fresh HF cache holding ``ex`` (the research doc's §5.3 recipe)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    fresh = DynamicCache(config=model.config)
    for layer, e in zip(fresh.layers, ex):
        if "k" in e:
            layer.lazy_initialization(e["k"], e["v"])
            layer.keys, layer.values = e["k"].clone(), e["v"].clone()
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = num_tokens
        if "conv" in e:
            layer.lazy_initialization(conv_states=e["conv"], state_idx=0, conv_kernel_size=e["ksz"])
            layer.conv_states[0].copy_(e["conv"])
            layer.lazy_initialization(recurrent_states=e["rec"], state_idx=0)
            layer.recurrent_states[0].copy_(e["rec"])
            layer.has_previous_state[0] = True
    return fresh


# ------------------------------------------------------------------------------- the move
def start_engines(pg: Pages, name: str) -> list[TransferEngine]:
    """One ``ipc`` TransferEngine per rank of ``pg`` (rank ``r`` on port base + ``r``)."""
    base = free_port_base(pg.tp) if pg.tp > 1 else 0
    out: list[TransferEngine] = []
    try:
        for r in range(pg.tp):
            eng = TransferEngine(pg.spec, pg.caches(r), r, pg.tp, name, transport="ipc", lease_s=60.0, port=base,
                                 auth_key=KEY, groups=pg.groups(), null_block=NULL_BLOCK)  # fmt: skip
            out.append(eng.start())
    except BaseException:
        for e in out:
            e.close()
        raise
    return out


def _poll(engs: list[TransferEngine], side: str, timeout: float = 60.0) -> str:
    """Poll every engine until each reports the request: "done" when every one did, else the
    first other outcome ("failed: ...", "expired", "timed out")."""
    outcome: list[str | None] = [None] * len(engs)
    end = time.monotonic() + timeout
    while None in outcome and time.monotonic() < end:
        for i, e in enumerate(engs):
            r = e.poll()
            if side == "recv":
                if "req" in r.finished_recving:
                    outcome[i] = "done"
                if "req" in r.failed:
                    outcome[i] = "failed: " + r.errors.get("req", "")
            else:
                if "req" in r.finished_sending:
                    outcome[i] = "done"
                if "req" in r.expired:
                    outcome[i] = "expired"
        time.sleep(0.002)
    return next((o or "timed out" for o in outcome if o != "done"), "done")


def move(p: Pages, d: Pages, num_tokens: int) -> dict:
    """The request from P's engines into D's (one export per P rank, one load per D rank);
    what the engines reported and counted."""
    ps, ds = start_engines(p, "P"), []
    try:
        ds = start_engines(d, "D")
        t0 = time.perf_counter()
        params = [e.export("req", p.block_lists(), num_tokens) for e in ps]
        held_exported = sum(e.stats()["blocks_held"] for e in ps)
        for e in ds:
            e.load("req", params[0], d.block_lists())
        recv = _poll(ds, "recv")
        sent = _poll(ps, "send") if recv == "done" else "not polled"
        seconds = time.perf_counter() - t0
        return {
            "recv": recv,
            "sent": sent,
            "same_params": all(x == params[0] for x in params),
            "p_blocks_held_exported": held_exported,
            "p_blocks_held_end": sum(e.stats()["blocks_held"] for e in ps),
            "bytes_recv": sum(e.stats()["bytes"] for e in ds),
            "move_s": round(seconds, 4),
        }
    finally:
        for e in ps + ds:
            e.close()


def bytes_needed(p: Pages, d: Pages, num_tokens: int) -> dict[str, int]:
    """Per group, the bytes the request needs on D's ranks together (every full-attention token,
    the sliding tokens the move carries, D's state content per rank), their total, and the
    bytes of moving every block of P's lists whole (the null positions as if live, the state
    page with its padding) on P's ranks together."""
    m, tok = p.m, 2 * KV_HEADS * HEAD_DIM * 4
    out = {"full": tok * num_tokens * len(m.full)}
    whole = len(p.full_ids) * len(m.full)
    if m.sliding:
        first = window_first(m, num_tokens)
        lo = max(first // d.bs * d.bs, first // p.bs * p.bs)
        out["sliding"] = tok * (num_tokens - lo) * len(m.sliding)
        whole += len(p.sliding_ids) * len(m.sliding)
    if m.state:
        out["state"] = d.tp * d.state_spec.content_bytes * len(m.state)
        whole += len(m.state)
    out["total"] = sum(out.values())
    out["every_block_whole"] = whole * p.page * p.tp
    return out


def mutate(d: Pages, what: str) -> str:
    """1 % off in D's pages: one state layer's conv or SSM state (every rank's share), or the
    last in-window block of a sliding layer (K and V, every rank's heads). Returns what."""
    m = d.m
    if what in ("conv", "ssm"):
        spec = d.state_spec
        lo, hi = (0, spec.conv_bytes) if what == "conv" else (spec.conv_bytes, spec.content_bytes)
        for r in range(d.tp):
            d.state_views(r)[0][d.state_id, lo:hi].view(torch.float32).mul_(1.01)
        return f"layer {m.state[0]}'s {what} state x 1.01"
    block = d.sliding_ids[-1]
    for r in range(d.tp):
        d.attn_views(r, len(m.sliding))[0][:, block].mul_(1.01)
    return f"layer {m.sliding[0]}'s last in-window block (id {block}, K and V) x 1.01"


# ------------------------------------------------------------------------------ the check
P_SIDE = (Layout.HND, "SD", False, 8)  # layout, conv layout, GDN SSM [h, K, V]?, block size step
D_SIDE = (Layout.NHD, "DS", True, 6)


def check_model(name: str, num_tokens: int, atol: float, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg, m = model_and_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (1, num_tokens), generator=g)
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        ex = extract(out.cache)
        full = torch.cat([prompt, torch.tensor([[token]])], dim=1)
        ref = torch.log_softmax(model(full).logits[0, -1].double(), -1)

    def decode(cache_ex) -> torch.Tensor:
        with torch.no_grad():
            logits = model(
                torch.tensor([[token]]), cache=inject(model, cache_ex, num_tokens), use_cache=True
            ).logits
        return torch.log_softmax(logits[0, -1].double(), -1)

    def side(tp: int, s: tuple, seed: int, fill: int) -> Pages:
        layout, conv_layout, transposed, step = s
        return Pages(m, tp, step, layout, conv_layout, transposed, num_tokens, seed, fill)

    def label(pg: Pages) -> str:
        lay = "HND" if pg.layout is Layout.HND else "NHD"
        st = pg.state_spec
        extra = (f" {st.conv_layout.value}" if st else "") + (
            (" [h,K,V]" if st.ssm_transposed else " [h,V,K]") if m.gdn else ""
        )
        return f"TP{pg.tp} {lay}/{pg.bs}{extra}"

    res = {"model": name, "tokens": num_tokens, "directions": []}
    mutations = (["conv", "ssm"] if m.state else []) + (["window"] if m.sliding else [])
    for p_tp, d_tp in ((2, 1), (1, 2)):
        p = side(p_tp, P_SIDE, seed + 1, GARBAGE)
        d = side(d_tp, D_SIDE, seed + 2, POISON)
        p.write(ex, num_tokens)
        want = side(d_tp, D_SIDE, seed + 2, POISON)  # the same block ids as D's
        want.write(ex, num_tokens)  # HF's cache straight into D's layout: what D must hold
        want.carry_before_window(p, num_tokens)
        p_before = [b.clone() for b in p.bufs]
        moved = move(p, d, num_tokens)
        bytes_exact = all(torch.equal(a, b) for a, b in zip(d.bufs, want.bufs))
        p_untouched = all(torch.equal(a, b) for a, b in zip(p.bufs, p_before))
        got, problems = d.read(num_tokens, ex)
        lp = decode(got)
        diff = float((lp - ref).abs().max())
        argmax = int(lp.argmax()) == int(ref.argmax())
        need = bytes_needed(p, d, num_tokens)
        engine_ok = (
            moved["recv"] == "done" and moved["sent"] == "done" and moved["same_params"]
            and moved["p_blocks_held_end"] == 0 and moved["bytes_recv"] == need["total"]
        )  # fmt: skip
        held = diff <= atol and argmax and bytes_exact and p_untouched and not problems and engine_ok
        row = {
            "p": label(p),
            "d": label(d),
            "p_block_size": p.bs,
            "d_block_size": d.bs,
            "ops": "engine/ipc",
            "max_abs_logprob_diff": diff,
            "argmax_equal": argmax,
            "bytes_exact": bytes_exact,
            "p_untouched": p_untouched,
            "replica_problems": problems,
            "engine": moved,
            "bytes_needed": need,
            "held": held,
            "mutations": {},
        }
        clean = [b.clone() for b in d.bufs]
        for what in mutations:
            text = mutate(d, what)
            got, _ = d.read(num_tokens, ex)
            mdiff = float((decode(got) - ref).abs().max())
            row["mutations"][what] = {
                "what": text,
                "max_abs_logprob_diff": mdiff,
                "failed": not mdiff <= atol,
            }
            for b, c in zip(d.bufs, clean):
                b.copy_(c)
        res["directions"].append(row)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3_next,granite,gemma3", help="comma-separated")
    p.add_argument("--tokens", type=int, default=101, help="prompt tokens P prefills")
    p.add_argument("--atol", type=float, default=1e-4, help="largest |log-probability difference| allowed")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    results = [check_model(name, a.tokens, a.atol, a.seed) for name in a.models.split(",") if name]
    ok = True
    for res in results:
        for row in res["directions"]:
            mut = ", ".join(f"{k} {v['max_abs_logprob_diff']:.2e} ({'fails' if v['failed'] else 'HELD'})"
                            for k, v in row["mutations"].items())  # fmt: skip
            eng, need = row["engine"], row["bytes_needed"]
            print(
                f"{res['model']:10s} {row['p']:>22s} -> {row['d']:22s} {row['ops']}: {eng['recv']}, "
                f"max|dlogp| {row['max_abs_logprob_diff']:.2e} argmax {'=' if row['argmax_equal'] else '!='} "
                f"bytes {'exact' if row['bytes_exact'] else 'DIFFER'}, moved {eng['bytes_recv']} B "
                f"(needed {need['total']}, every block whole {need['every_block_whole']}), "
                f"P holds {eng['p_blocks_held_end']} -> {'held' if row['held'] else 'FAILED'}; mutations: {mut}"
            )
            ok &= row["held"] and all(v["failed"] for v in row["mutations"].values())
    print("check " + ("held" if ok else "FAILED") + f" (atol {a.atol}, {a.tokens} tokens)")
    print(json.dumps({"ok": ok, "atol": a.atol, "results": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
