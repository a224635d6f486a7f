"""Tier-3 harness: two vLLM engines in separate processes hand requests over through kvxfer.

Run from the repository root, in an environment with a vLLM that runs on this machine (e.g.
``bash scripts/vllm_env.sh 0.32`` on a CPU box)::

    .venv-vllm0.32/bin/python -m tests.vllm_e2e [--lengths 1,31,33,70,97,160] [--tokens 8]
        [--mutate-k] [--deadline 900]
    .venv-vllm0.32/bin/python -m tests.vllm_e2e --write-model DIR   # the tiny model, for trying servers

A tiny Llama is initialised by transformers (its own random init, seeded) and saved with a
byte-level tokenizer to a temporary directory; no download. Three processes: a plain engine (the
reference), P (``kv_producer``: prefill, ``max_tokens=1``) and D (``kv_consumer``: decode from
P's KV). Random prompts of each length, one after another, then a prompt that shares the first
two blocks of the 70-token one (a prefix hit on D: only the rest is loaded). P hands the first
prompt off alone (D handshakes and maps P on its load), then the rest, as a server's later
requests come: over ``ipc`` each of them must be read one-sided. Checked per prompt: D's greedy
tokens equal the reference's, the log-probability of every generated token is within
``--atol`` (1e-5, fp32) of the reference's, D loaded the prompt (one transfer, the exact bytes
of the blocks it lacked; one-sided after the first), and at the end P holds no blocks.

``--model granite`` (a tiny GraniteMoeHybrid: Mamba2 + attention, fp32) and ``--model
qwen3_next`` (a tiny Qwen3-Next: Gated DeltaNet + full attention, bf16, the only dtype vLLM's CPU
GDN path takes) have state groups: vLLM's hybrid allocator on, prefix caching off (state groups
in its "align" mode are not carried), P prefills N−1 prompt tokens and D computes the last one
from the loaded state (the N−1 flow); a one-token prompt is not handed off. ``--mutate-state
ssm`` (or ``conv``) multiplies the SSM (or conv) state of the first state layer's loaded page of
the 70-token prompt by 1.01 on D right after its load: the run must then fail. Test knobs
(environment): ``KVXFER_E2E_REF_CHUNK=C`` makes the reference prefill in chunks of ``C`` tokens
(a prompt of ``C + 1`` tokens is then computed exactly as P and D compute it: compare it with
``--atol 0``, the way to check bf16 exactly), ``KVXFER_E2E_MUTATE_LEN`` picks the mutated
prompt's length, ``KVXFER_E2E_MUTATE_FACTOR`` the state mutation's factor (1.01).

``--mutate-k`` multiplies the K of one loaded block (the last, partial block of the 70-token
prompt, every layer and head) by 1.01 on D right after its load is reported: the run must then
fail (``ok`` false, the mismatch listed). Every process is joined against one deadline and
leftovers are killed. Prints one JSON line; exits 0 when every check held.
The tiny models, prompts and expected bytes are in ``tests/vllm_models.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.vllm_models import (
    BLOCK,
    DEFAULT_LENGTHS,
    DTYPES,
    MUTATE_LEN,
    STATE_MODELS,
    expected_bytes,
    handed_off,
    layer_windows,
    one_sided_problems,
    prompts,
    sliding,
    state_bytes,
    write_model,
)

HOST = "127.0.0.1"


def _env() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _llm(model_dir: str, kv: dict | None, kind: str = "llama"):
    from vllm import LLM

    kw = {}
    chunk = int(os.environ.get("KVXFER_E2E_REF_CHUNK", "0"))
    if kv is None and chunk:  # the reference prefills in chunks of this many tokens (a noise baseline)
        kw["max_num_batched_tokens"] = chunk
    if kv is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**kv)
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=DTYPES.get(kind, "float32"),
        block_size=BLOCK,  # vLLM raises it for a state model (its attention page holds a state page)
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        # state models: prefix caching ("align" mode states) only when asked (vLLM's default is on)
        enable_prefix_caching=kind not in STATE_MODELS or os.environ.get("KVXFER_E2E_PREFIX_CACHING") == "1",
        seed=0,
        **kw,
    )


def _gen(llm, prompt: list[int], max_tokens: int, params: dict | None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, extra_args=extra)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return out


def _sampled(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    toks = list(c.token_ids)
    return toks, [float(lp[t].logprob) for t, lp in zip(toks, c.logprobs)]


def _reference(model_dir, ps, n, q, kind="llama"):
    _env()
    llm = _llm(model_dir, None, kind)
    q.put(("ref", [_sampled(_gen(llm, p, n, None)) for p in ps]))


def _connector(role: str, engine_id: str, port: int) -> dict:
    return {
        "kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.vllm",
        "kv_role": role,
        "kv_port": port,
        "engine_id": engine_id,
        # a lease outliving D's start on a busy 2-core host (the default 30 s expired there)
        "kv_connector_extra_config": {"host": HOST, "lease_s": 120.0},
    }


def _step_until(llm, done, end: float) -> None:
    """Step P's engine (its connector exports on a step after the request finished) until
    ``done()`` or ``end``."""
    while not done() and time.monotonic() < end:
        llm.llm_engine.step()
        time.sleep(0.01)


def _prefill(model_dir, ps, port, q_params, q_done, q, deadline_s, kind="llama", q_go=None):
    """P: prefill every prompt; the first handed-off one goes to D alone (D handshakes and maps
    P on its load), the rest once D asks (``q_go``): their exports then open lease slots, so D
    reads them one-sided, as a server's later requests are read. Params go to D only once their
    exports exist."""
    _env()
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = _llm(model_dir, _connector("kv_producer", "P", port), kind)
    eng = get_kv_transfer_group().worker_side.engine

    def exported() -> int:
        s = eng.stats()
        return s.get("exports_live", 0) + s["finished_exports"] + s["expirations"]

    sched = llm.llm_engine.engine_core.engine_core.scheduler  # in-process EngineCore
    end = time.monotonic() + deadline_s
    out, sent, held_after_prefill = [], 0, 0
    for i, p in enumerate(ps):
        before = len(sched.requests)  # D frees nothing during a prefill: it has no params of it yet
        out.append(_gen(llm, p, 1, {"do_remote_decode": True}).kv_transfer_params)
        held_after_prefill += len(sched.requests) - before  # P holds the request's blocks for D
        if out[-1] is not None and not sent and i + 1 < len(ps) and q_go is not None:
            _step_until(llm, lambda: exported() >= 1, end)
            q_params.put(out)
            sent = len(out)
            # D loaded it (P is mapped) and P freed it (no free during the next prefills)
            _step_until(llm, lambda: not q_go.empty() and not sched.requests, end)
    want = sum(x is not None for x in out)
    _step_until(llm, lambda: exported() >= want, end)
    q_params.put(out[sent:])
    end = time.monotonic() + deadline_s
    while sched.requests and time.monotonic() < end:  # step until D's notifications freed them
        llm.llm_engine.step()
        time.sleep(0.01)
    with contextlib.suppress(queue.Empty):  # D done (it may still notify while we wait)
        q_done.get(timeout=max(1.0, end - time.monotonic()))
    pool = sched.kv_cache_manager.block_pool
    q.put(
        (
            "p",
            {
                "held_after_prefill": held_after_prefill,
                "requests_left": len(sched.requests),
                "free_blocks": pool.get_num_free_blocks(),
                "num_blocks": pool.num_gpu_blocks,
            },
        )
    )


def _mutate_k_of_last_loaded_block(worker, target_rid: str) -> None:
    """Test hook (D process): when ``target_rid``'s load is reported, multiply the K half of its
    last block by 1.01 in every layer and head (kvxfer views: [2, B, H, N, d])."""
    blocks: dict[str, list[int]] = {}
    start, finished = worker.start, worker.finished

    def start_hook(meta):
        for ld in meta.loads:  # KV cache groups: the last group's list (Gemma-3: full attention)
            ids = ld.block_ids
            blocks[ld.request_id] = list(ids[-1] if ids and isinstance(ids[0], list) else ids)
        return start(meta)

    def finished_hook():
        sending, recving = finished()
        if target_rid in recving:
            last = blocks[target_rid][-1]
            for view in worker.engine.caches:
                view[0, last].mul_(1.01)
        return sending, recving

    worker.start, worker.finished = start_hook, finished_hook


def _mutate_state_of_loaded_page(worker, target_rid: str, what: str) -> None:
    """Test hook (D process): when ``target_rid``'s load is reported, multiply the SSM (``what``
    "ssm") or conv ("conv") state of the first state layer's loaded page by 1.01 (vLLM's own
    int8 view of the layer: conv bytes, then SSM bytes)."""

    from kvxfer.groups.blocks import state_block

    g = next(x for x in worker.groups if x.is_state)
    st, name = g.state, g.layer_names[0]
    pos = worker.groups.index(g)
    blocks: dict[str, int] = {}
    start, finished = worker.start, worker.finished

    def start_hook(meta):
        for ld in meta.loads:
            blocks[ld.request_id] = state_block(ld.block_ids[pos], g.num_speculative_blocks)
        return start(meta)

    def finished_hook():
        sending, recving = finished()
        if target_rid in recving:
            page = worker.state_caches[name][blocks[target_rid], 0, 0]
            if what == "conv":
                part, dt = page[: st.conv_bytes], st.conv_dtype
            else:
                part, dt = page[st.conv_bytes : st.conv_bytes + st.ssm_bytes], st.ssm_dtype
            v = part.view(dt)
            v.copy_((v.float() * float(os.environ.get("KVXFER_E2E_MUTATE_FACTOR", "1.01"))).to(dt))
        return sending, recving

    worker.start, worker.finished = start_hook, finished_hook


def _decode(model_dir, ps, n, q_params, q_done, q, mutate, kind="llama", q_go=None):
    _env()
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = _llm(model_dir, _connector("kv_consumer", "D", 0), kind)
    params = q_params.get(timeout=600)
    worker = get_kv_transfer_group().worker_side
    results = []
    last = {"transfers": 0, "bytes": 0, "failures": 0, "latency_sum_s": 0.0, "onesided_loads": 0}
    for i, p in enumerate(ps):
        if i == len(params):  # P sent the first hand-off alone: ask for the rest
            if q_go is not None:
                q_go.put(True)
            params += q_params.get(timeout=600)
        prm = params[i]
        if mutate and len(p) == int(os.environ.get("KVXFER_E2E_MUTATE_LEN", MUTATE_LEN)) and prm is not None:
            out = _gen_mutated(llm, worker, p, n, prm, f"mutate-{i}", mutate)
        else:
            out = _gen(llm, p, n, prm)
        s = worker.engine.stats()
        s["onesided_loads"] = s["onesided"].get("loads", 0)
        toks, lps = _sampled(out)
        results.append(
            {
                "handed_off": prm is not None,  # P gave params (a sliding window may prevent it)
                "tokens": toks,
                "logprobs": lps,
                "num_cached_tokens": getattr(out, "num_cached_tokens", None),
                **{k: s[k] - last[k] for k in last},
            }
        )
        last = {k: s[k] for k in last}
    q_done.put(True)
    st = worker.engine.stats()
    spec = worker.engine.spec
    q.put(
        (
            "d",
            {
                "results": results,
                "block_size": spec.block_size,
                "num_layers": spec.num_layers,
                "groups": [
                    {
                        "state": g.is_state,
                        "layers": len(g.layer_names),
                        "window": g.window,
                        "content_bytes": g.state.content_bytes if g.is_state else 0,
                    }
                    for g in worker.groups or ()
                ],
                "bytes_per_token": worker.engine.spec.bytes_per_token(),
                "transports": st["transports"],
                "onesided": st.get("onesided"),
                "latency_p50_s": st["p50_s"],
            },
        )
    )


def _sp(n, prm):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0, extra_args={"kv_transfer_params": prm}
    )


def _gen_mutated(llm, worker, prompt, n, prm, rid, what=True):
    """One request through the engine's own API (add, then step until done), its last loaded
    block's K perturbed on arrival (the hook needs the engine's id of the request)."""
    eng = llm.llm_engine
    internal = eng.add_request(rid, {"prompt_token_ids": prompt}, _sp(n, prm))
    target = internal if isinstance(internal, str) else rid
    if what in ("ssm", "conv"):
        _mutate_state_of_loaded_page(worker, target, what)
    else:
        _mutate_k_of_last_loaded_block(worker, target)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        for out in eng.step():
            if out.request_id in (rid, internal) and out.finished:
                return out
    raise TimeoutError(f"request {rid} did not finish in 300 s")


def _entry(fn, args, q):
    try:
        fn(*args)
    except BaseException as e:
        q.put(("error", f"{fn.__name__}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def check(ps, ref, d, pinfo, tokens_moved, atol: float) -> list[str]:
    """What differs (empty when every check held). ``tokens_moved``: per prompt, the bytes the
    load must move, or the tokens of every layer it must move (when ``d`` has no ``windows``)."""
    bad = []
    for i, (p, (rt, rl), got) in enumerate(zip(ps, ref, d["results"])):
        tag = f"prompt {i} ({len(p)} tokens)"
        if got["tokens"] != rt:
            bad.append(f"{tag}: tokens {got['tokens']} != reference {rt}")
        diffs = [abs(a - b) for a, b in zip(got["logprobs"], rl)]
        if len(got["logprobs"]) != len(rl) or max(diffs, default=0.0) > atol:
            bad.append(f"{tag}: logprob differs by {max(diffs, default=float('nan')):.3g} > {atol}")
        if not got["tokens"]:
            bad.append(f"{tag}: an empty answer")
        want_t = 1 if got.get("handed_off", True) else 0
        if got["transfers"] != want_t or got["failures"] != 0:
            bad.append(f"{tag}: {got['transfers']} transfers, {got['failures']} failures (want {want_t}, 0)")
        want_bytes = (
            tokens_moved[i] if d.get("windows") else tokens_moved[i] * d["bytes_per_token"]
        ) * want_t
        if got["bytes"] != want_bytes:
            bad.append(f"{tag}: moved {got['bytes']} bytes, want {want_bytes}")
    if (
        pinfo["requests_left"] or pinfo["free_blocks"] != pinfo["num_blocks"] - 1
    ):  # block 0: vLLM's null block
        bad.append(f"P still holds blocks: {pinfo}")
    return bad


def run(
    lengths=DEFAULT_LENGTHS,
    tokens: int = 8,
    deadline_s: float = 900.0,
    mutate: bool | str = False,
    atol: float = 1e-5,
    sliding_window: int = 0,
    kind: str = "llama",
) -> dict:
    """Run the three engines; returns the result dict (``ok``: every check held).
    ``sliding_window``: every layer attends to that many tokens (a uniform sliding-window model:
    one ``SlidingWindowSpec`` KV cache group). ``kind``: "llama", "gemma3" (sliding and full
    attention groups), "granite" or "qwen3_next" (state groups: the N-1 flow). ``mutate``: True
    (one loaded block's K), "ssm" or "conv" (one loaded state page's SSM or conv state)."""
    from kvxfer.ports import free_port_base

    ps = prompts(lengths)
    ctx = mp.get_context("spawn")
    q, q_params, q_done, q_go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    end = time.monotonic() + deadline_s
    got: dict = {}
    with tempfile.TemporaryDirectory() as model_dir:
        write_model(model_dir, kind=kind, **(sliding(sliding_window) if kind == "llama" else {}))
        procs = [
            ctx.Process(target=_entry, args=(_reference, (model_dir, ps, tokens, q, kind), q), name="ref")
        ]
        procs[0].start()
        procs[0].join(deadline_s / 2)  # one engine at a time on a small machine, then P and D
        port = free_port_base(1)
        procs += [
            ctx.Process(
                target=_entry,
                args=(_prefill, (model_dir, ps, port, q_params, q_done, q, deadline_s / 3, kind, q_go), q),
                name="P",
            ),
            ctx.Process(
                target=_entry,
                args=(_decode, (model_dir, ps, tokens, q_params, q_done, q, mutate, kind, q_go), q),
                name="D",
            ),
        ]
        for p in procs[1:]:
            p.start()
        while len(got) < 3 and time.monotonic() < end and "error" not in got:
            try:
                k, v = q.get(timeout=1.0)
                got[k] = v
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
        for p in procs:
            p.join(max(0.1, min(30.0, end - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5)
                got.setdefault("killed", []).append(p.name)
    ref, d, pinfo = got.get("ref"), got.get("d"), got.get("p")
    problems = ["missing results"] if not (ref and d and pinfo) else []
    windows = layer_windows(kind, sliding_window)
    grouped = any(w is not None for w in windows)
    if not problems and kind in STATE_MODELS:  # the N-1 flow: whole pages, one state page per layer
        d["windows"] = windows
        for p, r in zip(ps, d["results"]):
            r["state_bytes"] = state_bytes(len(p), d)
        problems = check(ps, ref, d, pinfo, [r["state_bytes"]["want"] for r in d["results"]], atol)
        for i, (p, r) in enumerate(zip(ps, d["results"])):
            if r["handed_off"] != (len(p) > 1):  # a one-token prompt: nothing to hand off
                problems.append(
                    f"prompt {i} ({len(p)} tokens): handed off {r['handed_off']}, want {len(p) > 1}"
                )
    elif not problems and grouped:  # KV cache groups: bytes per layer from its window
        d["windows"] = windows
        moved = [
            expected_bytes(len(p), r["num_cached_tokens"] or 0, windows, d["bytes_per_token"])
            for p, r in zip(ps, d["results"])
        ]
        problems = check(ps, ref, d, pinfo, moved, atol)
        for i, (p, r) in enumerate(zip(ps, d["results"])):
            want = handed_off(len(p), windows)
            if r["handed_off"] != want:
                problems.append(f"prompt {i} ({len(p)} tokens): handed off {r['handed_off']}, want {want}")
    elif not problems:
        hit = [2 * BLOCK if i == len(lengths) else 0 for i in range(len(ps))]  # the prefix-hit prompt
        moved = [-(-len(p) // BLOCK) * BLOCK - h for p, h in zip(ps, hit)]  # whole blocks (CPU_ATTN pages)
        problems = check(ps, ref, d, pinfo, moved, atol)
        if len(ps) > len(lengths) and (d["results"][-1]["num_cached_tokens"] or 0) < 2 * BLOCK:
            problems.append(
                f"prefix-hit prompt: D cached {d['results'][-1]['num_cached_tokens']} tokens, want 64"
            )
    if not problems:
        problems = one_sided_problems(d)
    ok = not problems and "error" not in got and "killed" not in got
    return {
        "ok": ok,
        "mutate_k": mutate,
        "sliding_window": sliding_window,
        "model": kind,
        "lengths": [len(p) for p in ps],
        "problems": problems,
        **got,
    }


def summary(res: dict) -> str:
    """Per prompt: length, tokens equal, largest logprob difference, bytes moved."""
    lines = []
    if res.get("ref") and res.get("d"):
        for n, (rt, rl), got in zip(res["lengths"], res["ref"], res["d"]["results"]):
            diff = max((abs(a - b) for a, b in zip(got["logprobs"], rl)), default=float("nan"))
            sb = got.get("state_bytes")
            if sb and got.get("transfers"):
                lines.append(
                    f"prompt {n:4d} tokens: moved {got['bytes']} B = {got['bytes'] / sb['minimum']:.2f}x the "
                    f"minimum {sb['minimum']} B (N-1 tokens' K/V + state content), "
                    f"{got['bytes'] / sb['everything']:.2f}x every layer's pages {sb['everything']} B"
                )
            lines.append(
                f"prompt {n:4d} tokens: tokens equal {got['tokens'] == rt}, max |logprob diff| {diff:.2e}, "
                f"first logprob D {(got['logprobs'] or [float('nan')])[0]:.6f} ref {rl[0]:.6f}, "
                f"cached {got['num_cached_tokens']}, "
                f"loaded {got['bytes']} bytes in {got['transfers']} transfer(s)"
                + (
                    f" ({got['latency_sum_s'] * 1e3:.1f} ms from load to landed"
                    + (", one-sided)" if got.get("onesided_loads") else ")")
                    if got.get("transfers")
                    else ""
                )
                + ("" if got.get("handed_off", True) else " (not handed off: D computed it)")
            )
    lines += [f"PROBLEM: {p}" for p in res.get("problems", [])]
    if "error" in res:
        lines.append(f"ERROR: {res['error']}")
    lines.append(f"ok: {res['ok']} (mutate_k={res['mutate_k']}, P: {res.get('p')})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=900.0)
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--mutate-k", action="store_true", help="perturb one loaded block's K by 1%% on D")
    ap.add_argument("--sliding-window", type=int, default=0, help="every layer attends to this many tokens")
    ap.add_argument(
        "--mutate-state",
        choices=("ssm", "conv"),
        help="perturb the SSM or conv state of one loaded state page by 1%% on D (granite, qwen3_next)",
    )
    ap.add_argument(
        "--model", choices=("llama", "gemma3", *STATE_MODELS), default="llama", help="the tiny model's family"
    )
    ap.add_argument("--write-model", metavar="DIR", help="only write the tiny model and tokenizer to DIR")
    a = ap.parse_args(argv)
    if a.write_model:
        os.makedirs(a.write_model, exist_ok=True)
        print(
            write_model(
                a.write_model, kind=a.model, **(sliding(a.sliding_window) if a.model == "llama" else {})
            )
        )
        return 0
    t0 = time.monotonic()
    lengths = tuple(int(x) for x in a.lengths.split(","))
    mutate = a.mutate_state or a.mutate_k
    res = run(lengths, a.tokens, a.deadline, mutate, a.atol, a.sliding_window, a.model)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    print(summary(res), file=sys.stderr)
    print(json.dumps(res, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
