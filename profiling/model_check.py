"""A real model's KV through kvxfer: a Hugging Face Llama with random weights, prefilled on P, its
KV moved over ``ipc`` into D's cache of another layout and block size, and D's next-token
log-probabilities set against a plain run's.

P (a process of its own) runs the prefill of a random prompt, writes each layer's K and V into its
paged cache (NHD, 16-token blocks, shuffled block ids) by plain indexing, twice, and exports the
two requests. D (this process) loads each into its cache (HND, 32-token blocks, other shuffled ids;
CPU: shared memory, GPU: CUDA IPC): the first load handshakes and maps P's cache (the messaged
path), the second reads one-sided. After each, D reads the KV back by plain indexing into the
model's cache and decodes one token. The reference is the plain run of the same model: the prompt
and that token in one forward. Neither side's indexing goes through kvxfer, so a copy that lands a
token's K or V, a head or a layer in the wrong place, or leaves one out, changes D's output. What
the model cannot see: whole tokens (K and V together) moved to other positions of the request,
since attention over the cache is a sum over its tokens and RoPE is already in the keys; the
byte-exact tests see that. The model is small (4 layers, GQA 4 query / 2 KV heads of 32, fp32), its
weights drawn by transformers' own initialisation (seeded, with a wider spread than its default:
see :func:`model_config`) and handed to P in a file, so both processes run the same model.

The check: the largest difference between D's and the reference's log-probabilities over the
vocabulary (``--atol``, default 1e-4; the exact KV gives 3.8e-6 on CPU) and the same argmax.
``--mutate`` scales the K of one token of one layer in D's cache by 1.01 after the load: the check
must then fail (it can).

    python profiling/model_check.py [--device cpu|cuda] [--tokens 37] [--mutate]

Prints the figures and one JSON line; exits 0 when the check held (with ``--mutate``: when it
failed, as it must). Needs ``transformers`` (the ``test`` extra brings it).
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common
from bench_transfer import mappable_caches

from kvxfer import KVCacheSpec, Layout, TransferEngine
from kvxfer.ports import free_port_base

DEADLINE_S = 120.0  # every wait of the check, and the join of P
LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 4, 2, 32, 512


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        attn_implementation="eager",
        # Weights 5x transformers' default spread: attention that depends on each token. With the
        # default (0.02) a 1 % change of one token's K moved D's log-probabilities by 4e-6, under
        # the fp32 noise's reach; here every such change tried (K or V of 7 tokens x 4 layers,
        # CPU) moved them by 1.5e-4 to 4e-3, against 3.8e-6 for the exact KV.
        initializer_range=0.1,
    )


def load_model(path: str, device: torch.device):
    """The checked model: transformers' Llama with the weights saved at ``path``, fp32, eval."""
    from transformers import LlamaForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products as fp32 (the check's noise floor)
    model = LlamaForCausalLM(model_config())
    model.load_state_dict(torch.load(path, map_location="cpu"))
    return model.to(device=device, dtype=torch.float32).eval()


def specs() -> tuple[KVCacheSpec, KVCacheSpec]:
    """P's cache (NHD, block 16) and D's (HND, block 32) of the model's K and V."""
    p = KVCacheSpec(LAYERS, KV_HEADS, HEAD_DIM, 16, torch.float32, Layout.NHD)
    return p, KVCacheSpec(LAYERS, KV_HEADS, HEAD_DIM, 32, torch.float32, Layout.HND)


def _slots(spec: KVCacheSpec, ids: list[int], num_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token its block and its offset in the block."""
    t = torch.arange(num_tokens, device=device)
    return torch.tensor(ids, device=device)[t // spec.block_size], t % spec.block_size


def write_kv(caches, spec: KVCacheSpec, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each layer's K and V (``[heads, tokens, head_dim]``) into the paged ``caches`` by plain
    indexing: token t at block ``ids[t // block_size]``, offset ``t % block_size``."""
    n = kv[0][0].shape[1]
    blk, off = _slots(spec, ids, n, caches[0].device)
    for cache, pair in zip(caches, kv):
        for s in (0, 1):  # K, V
            if spec.layout is Layout.NHD:  # [2, blocks, block_size, heads, head_dim]
                cache[s][blk, off] = pair[s].permute(1, 0, 2)
            else:  # HND: [2, blocks, heads, block_size, head_dim]
                cache[s][blk, :, off] = pair[s].permute(1, 0, 2)


def read_kv(
    caches, spec: KVCacheSpec, ids: list[int], num_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of :func:`write_kv`: each layer's (K, V) as ``[heads, tokens, head_dim]``."""
    blk, off = _slots(spec, ids, num_tokens, caches[0].device)
    out = []
    for cache in caches:
        if spec.layout is Layout.NHD:
            pair = tuple(cache[s][blk, off].permute(1, 0, 2) for s in (0, 1))
        else:
            pair = tuple(cache[s][blk, :, off].permute(1, 0, 2) for s in (0, 1))
        out.append(pair)
    return out


def model_kv(out) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) of a forward's cache, batch 0: ``[heads, tokens, head_dim]``."""
    cache = getattr(out, "cache", None)  # transformers 5 (past_key_values before, deprecated there)
    if cache is None:
        cache = out.past_key_values
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56: one object per layer
        return [(lay.keys[0], lay.values[0]) for lay in layers]
    return [(cache.key_cache[i][0], cache.value_cache[i][0]) for i in range(len(cache.key_cache))]


def decode_logprobs(model, kv, token: int, position: int) -> torch.Tensor:
    """Log-probabilities of the next token after ``token`` at ``position``, the prompt's KV given."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k[None].contiguous(), v[None].contiguous(), i)
    dev = kv[0][0].device
    ids = torch.tensor([[token]], device=dev)
    kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    with torch.no_grad():
        out = model(ids, position_ids=torch.tensor([[position]], device=dev), use_cache=True, **kw)
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


# ----------------------------------------------------------------------------------- P, a process
def exporter(args: dict, conn) -> None:
    """P: the prefill, its KV written into P's cache and exported; then serve until "stop"."""
    try:
        _exporter(args, conn)
    except BaseException as e:  # report, never hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _exporter(args: dict, conn) -> None:
    device = torch.device(args["device"])
    model = load_model(args["weights"], device)
    prompt = torch.tensor([args["prompt"]], device=device)
    with torch.no_grad():
        kv = model_kv(model(prompt, use_cache=True))
    p_spec, _ = specs()
    n = prompt.shape[1]
    shm, caches = mappable_caches(p_spec, args["blocks"], device, fill=False)
    for c in caches:
        c.fill_(float("nan"))  # blocks the request does not name: whatever lands from them shows
    for ids in args["ids"]:  # the same KV under two requests, in blocks of their own
        write_kv(caches, p_spec, ids, kv)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    eng = TransferEngine(p_spec, caches, 0, 1, "P", transport="ipc", port=args["port"], lease_s=60.0)
    eng.start()
    try:
        # one export per "export" command: the second comes after D mapped this rank's lease
        # slots (on its first load), so it gets a slot and D reads it one-sided
        end = time.monotonic() + DEADLINE_S
        want, done, stop = set(), set(), False
        while time.monotonic() < end and not (stop and done >= want):
            done |= eng.poll().finished_sending
            if not stop and conn.poll(0.001):
                cmd = conn.recv()
                if cmd[0] == "export":
                    k = len(want)
                    want.add(f"r{k}")
                    conn.send(("params", eng.export(f"r{k}", args["ids"][k], n)))
                elif cmd[0] == "stop":
                    stop = True
                    end = min(end, time.monotonic() + 5.0)  # D landed them: P frees at a poll soon
            elif stop:
                time.sleep(0.001)
        conn.send(("stopped", bool(want) and done >= want))
    finally:
        eng.close()
        if shm is not None:
            shm.close()


# ------------------------------------------------------------------------------------------- D
def _get(conn, kind: str, proc, deadline: float):
    return common.expect(conn, kind, proc, deadline - time.monotonic())


def run(a: argparse.Namespace) -> dict:
    from transformers import LlamaForCausalLM

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    p_spec, d_spec = specs()
    g = torch.Generator().manual_seed(a.seed)
    prompt = torch.randint(0, VOCAB, (a.tokens,), generator=g).tolist()
    pn, dn = p_spec.num_blocks_for(a.tokens), d_spec.num_blocks_for(a.tokens)
    p_blocks, d_blocks = 2 * pn + 3, 2 * dn + 3  # two requests, and a few blocks neither names
    p_perm, d_perm = (
        torch.randperm(p_blocks, generator=g).tolist(),
        torch.randperm(d_blocks, generator=g).tolist(),
    )
    p_ids = [p_perm[:pn], p_perm[pn : 2 * pn]]
    d_ids = [d_perm[:dn], d_perm[dn : 2 * dn]]
    torch.manual_seed(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "llama.pt")
        torch.save(LlamaForCausalLM(model_config()).state_dict(), weights)  # transformers' own init
        model = load_model(weights, device)
        # the reference: the plain run, the prompt and the next token in one forward
        with torch.no_grad():
            first = int(model(torch.tensor([prompt], device=device)).logits[0, -1].argmax())
            ref = torch.log_softmax(
                model(torch.tensor([[*prompt, first]], device=device)).logits[0, -1].float(), -1
            )
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        args = {"device": str(device), "weights": weights, "prompt": prompt, "ids": p_ids,
                "blocks": p_blocks, "port": free_port_base(1)}  # fmt: skip
        proc = ctx.Process(target=exporter, args=(args, there), daemon=True)
        proc.start()
        shm, caches = mappable_caches(d_spec, d_blocks, device, fill=False)
        eng = TransferEngine(d_spec, caches, 0, 1, "D", transport="ipc", lease_s=60.0).start()
        deadline = time.monotonic() + DEADLINE_S
        try:
            # r0: the first load from P handshakes and maps P's cache (the messaged path); r1, the
            # remote mapped, reads one-sided (load() launches the copy)
            diffs, load_ms, argmax_equal = [], [], []
            for rid, ids in zip(("r0", "r1"), d_ids):
                here.send(("export",))
                params = _get(here, "params", proc, deadline)[1]
                t0 = time.perf_counter()
                eng.load(rid, params, ids)
                r = eng.wait([rid], max(0.0, deadline - time.monotonic()))
                load_ms.append((time.perf_counter() - t0) * 1e3)
                if rid not in r.finished_recving:
                    raise RuntimeError(f"the load of {rid} did not finish: {r.errors or 'timed out'}")
                if a.mutate:  # one token's K of one layer off by 1 %: the check must see it
                    tok = a.tokens // 2
                    blk, off = ids[tok // d_spec.block_size], tok % d_spec.block_size
                    caches[LAYERS // 2][0][blk, :, off] *= 1.01
                got = decode_logprobs(model, read_kv(caches, d_spec, ids, a.tokens), first, a.tokens)
                diffs.append(float((got - ref).abs().max()))
                argmax_equal.append(int(got.argmax()) == int(ref.argmax()))
            onesided = eng.stats()["onesided"].get("loads", 0)
            here.send(("stop",))
            freed = _get(here, "stopped", proc, deadline)[1]
        finally:
            eng.close()
            proc.join(max(1.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            if shm is not None:
                shm.close()
    diff = max(diffs)
    same = all(argmax_equal)
    held = diff <= a.atol and same
    return {
        "device": str(device),
        "transformers": __import__("transformers").__version__,
        "tokens": a.tokens,
        "p": f"{p_spec.layout.value}/{p_spec.block_size}",
        "d": f"{d_spec.layout.value}/{d_spec.block_size}",
        "max_abs_logprob_diff": diff,
        "logprob_diff_per_load": diffs,  # r0 (messaged), r1 (one-sided)
        "onesided_loads": onesided,
        "argmax_equal": same,
        "atol": a.atol,
        "p_freed": bool(freed),
        "load_ms": load_ms,
        "mutated": a.mutate,
        "held": held,
        "ok": (not held) if a.mutate else (held and bool(freed)),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when present)")
    p.add_argument(
        "--tokens", type=int, default=37, help="prompt length (default 37: partial blocks on both sides)"
    )
    p.add_argument("--atol", type=float, default=1e-4, help="largest log-probability difference allowed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mutate", action="store_true", help="K of one token off by 1 %% on D: must fail")
    a = p.parse_args(argv)
    if not 2 <= a.tokens <= 400:
        p.error(f"--tokens: {a.tokens} is not in [2, 400]")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    res = run(a)
    print(
        f"# model check on {res['device']} (transformers {res['transformers']}): {a.tokens}-token prompt, "
        f"P {res['p']} -> D {res['d']} over ipc{', one K scaled by 1.01 on D' if a.mutate else ''}"
    )
    print(
        f"max |logprob(D) - logprob(plain)| = {res['max_abs_logprob_diff']:.3g} (atol {a.atol:g}), "
        f"argmax equal: {res['argmax_equal']}, P freed the blocks: {res['p_freed']}; per load "
        f"(messaged, one-sided: {res['onesided_loads']} read so): {', '.join(f'{d:.3g}' for d in res['logprob_diff_per_load'])}, "
        f"{', '.join(f'{t:.1f}' for t in res['load_ms'])} ms"
    )
    print(f"check {'held' if res['held'] else 'FAILED'}: {'OK' if res['ok'] else 'WRONG'}")
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
