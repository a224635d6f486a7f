"""The HTTP plumbing of the served-mode harness (``tests/vllm_served.py``), also used by
``profiling/bench_vllm_pd.py``.

:class:`Server`: one ``vllm.entrypoints.openai.api_server`` in a process group of its own (start,
wait until ready, stop, kill, its log); :func:`get`, :func:`post`, :func:`kv_usage` (the
server's ``vllm:kv_cache_usage_perc``) and :func:`kv_stats` (the connector counters vLLM logged).
The routers, each in a thread of this process: :class:`KvxferRouter` (:mod:`kvxfer.vllm.proxy`)
and :class:`StandardRouter`, vLLM's disaggregated-proxy protocol as its example proxies and the
ecosystem's routers speak it, written here: P gets the request with ``max_tokens=1``, no
streaming, ``kv_transfer_params`` of :data:`STANDARD_PREFILL_PARAMS` and an ``X-Request-Id``
header; D gets the original request with P's ``kv_transfer_params`` as they came and the same
header. The requests: :func:`body_of`, :func:`answer`, :func:`at_once`, :func:`drop_stream` (a
client closing its stream after the first event) and :func:`wait_idle`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDARD_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# ----------------------------------------------------------------------------- servers
class Server:
    """One ``vllm.entrypoints.openai.api_server`` in a process group of its own."""

    def __init__(self, name: str, port: int, model_dir: str, log_dir: str, args: list[str], env: dict):
        self.name, self.port, self.args, self.env = name, port, args, env
        self.model_dir = model_dir
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.proc: subprocess.Popen | None = None
        self.url = f"http://{HOST}:{port}"

    def start(self) -> Server:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
            "--host", HOST, "--port", str(self.port), *self.args,
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it; closed with the child
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT, start_new_session=True
        )
        log.close()
        self.t_start = time.monotonic()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_gone(self, timeout_s: float = 10.0) -> bool:
        """Wait until every process of the server's group has exited (reaping the server's
        own process); whether they did within ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.proc.poll()
            if not _group_alive(self.proc.pid):
                return True
            time.sleep(0.002)
        return False

    def wait_ready(self, deadline: float) -> float:
        """Seconds from start until /health answered; RuntimeError (with the log's tail) if the
        server died or the deadline passed."""
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode}) while starting:\n{self.tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                if get(self.url, "/health", 2.0)[0] == 200:
                    return time.monotonic() - self.t_start
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready by the deadline:\n{self.tail()}")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``grace_s``."""
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            if self.proc.poll() is not None and not _group_alive(self.proc.pid):
                break
            time.sleep(0.2)
        self.kill(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError as e:
            return f"(no log: {e})"

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def get(url: str, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def post(url: str, path: str, body: dict, timeout: float = 300.0, headers: dict | None = None):
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        c.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def kv_usage(url: str) -> float | None:
    """``vllm:kv_cache_usage_perc`` of a server (None if it does not answer)."""
    try:
        status, data = get(url, "/metrics", 5.0)
    except (OSError, http.client.HTTPException):
        return None
    m = re.search(rb"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.eE+-]+)", data, re.M)
    return float(m.group(1)) if status == 200 and m else None


def kv_stats(log: str) -> dict:
    """The connector counters vLLM logged (``KV Transfer metrics: kvxfer_transfers=...``), summed."""
    out: dict = {"loads_failed_logged": 0}
    for line in log.splitlines():
        if line.startswith("kvxfer: load of ") and " failed (" in line:
            out["loads_failed_logged"] += 1  # the worker's own line: counted even where vLLM's
            continue  # logged interval misses it
        if "KV Transfer metrics:" not in line:
            continue
        for k, v in re.findall(r"(kvxfer_\w+)=([0-9.eE+-]+)", line):
            if k in ("kvxfer_transfers", "kvxfer_failures", "kvxfer_expirations", "kvxfer_bytes"):
                out[k] = out.get(k, 0) + int(float(v))
    return out


# ----------------------------------------------------------------------------- routers
class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 512  # socketserver's 5 had the kernel reset some of 32 clients at once
    daemon_threads = True


class StandardRouter:
    """vLLM's disaggregated-proxy protocol (see the module doc), one P and one D, in a thread:
    written for this harness from the protocol, not taken from vLLM's example."""

    def __init__(
        self, p_url: str, d_url: str, after_prefill=None, timeout_s: float = 300.0, timings=None
    ) -> None:
        p, d = urllib.parse.urlsplit(p_url), urllib.parse.urlsplit(d_url)
        hook = after_prefill
        times = timings  # X-Request-Id -> (P's answer received, D's first bytes received), monotonic

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, data: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                rid = self.headers.get("X-Request-Id") or str(uuid.uuid4())
                hdr = {"Content-Type": "application/json", "X-Request-Id": rid}
                pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
                pre.update(max_tokens=1, stream=False, kv_transfer_params=dict(STANDARD_PREFILL_PARAMS))
                if "max_completion_tokens" in pre:
                    pre["max_completion_tokens"] = 1
                c = http.client.HTTPConnection(p.hostname, p.port, timeout=timeout_s)
                try:
                    c.request("POST", self.path, body=json.dumps(pre), headers=hdr)
                    r = c.getresponse()
                    status, data = r.status, r.read()
                except OSError as e:
                    self._send(502, json.dumps({"error": f"router: prefill {p_url}: {e}"}).encode())
                    return
                finally:
                    c.close()
                if status != 200:
                    self._send(status, data)
                    return
                t_p = time.monotonic()
                kv = json.loads(data).get("kv_transfer_params")
                if hook is not None:
                    hook(p_url, kv)
                body["kv_transfer_params"] = kv
                c = http.client.HTTPConnection(d.hostname, d.port, timeout=timeout_s)
                try:
                    c.request("POST", self.path, body=json.dumps(body), headers=hdr)
                    r = c.getresponse()
                    self.send_response(r.status)
                    self.send_header("Content-Type", r.getheader("Content-Type", "application/json"))
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while chunk := r.read1(65536):
                        if times is not None and rid not in times:
                            times[rid] = (t_p, time.monotonic())
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                except OSError as e:
                    self._send(502, json.dumps({"error": f"router: decode {d_url}: {e}"}).encode())
                finally:
                    c.close()

        self.srv = _HTTPServer((HOST, 0), H)
        self.url = f"http://{HOST}:{self.srv.server_port}"

    def start(self):
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()
        self.thread.join(5)


class KvxferRouter:
    """:mod:`kvxfer.vllm.proxy` in a thread of this process."""

    def __init__(self, p_url: str, d_url: str, after_prefill=None, timeout_s: float = 300.0) -> None:
        from kvxfer.vllm.proxy import make_server

        self.srv = make_server(HOST, 0, [p_url], [d_url], timeout_s, after_prefill=after_prefill)
        self.url = f"http://{HOST}:{self.srv.server_port}"

    start = StandardRouter.start
    close = StandardRouter.close


ROUTERS = {"kvxfer": KvxferRouter, "standard": StandardRouter}


# ----------------------------------------------------------------------------- requests
def body_of(model: str, prompt: list[int], tokens: int, stream: bool = False) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
        "stream": stream,
    }


def answer(url: str, body: dict, timeout: float = 300.0) -> dict:
    """POST a completion; {'status', 'tokens', 'logprobs', 'error', 's'}."""
    t0 = time.monotonic()
    try:
        status, data = post(url, "/v1/completions", body, timeout)
    except (OSError, http.client.HTTPException) as e:
        return {"status": 0, "tokens": [], "logprobs": [], "error": f"{type(e).__name__}: {e}", "s": 0.0}
    out = {"status": status, "tokens": [], "logprobs": [], "error": "", "s": time.monotonic() - t0}
    try:
        d = json.loads(data)
    except ValueError:
        out["error"] = data[:500].decode(errors="replace")
        return out
    if status != 200 or "choices" not in d:
        out["error"] = json.dumps(d.get("error", d))[:1000]
        return out
    c = d["choices"][0]
    out["tokens"] = list(c.get("token_ids") or [])
    out["logprobs"] = [float(x) for x in (c.get("logprobs") or {}).get("token_logprobs") or []]
    return out


def at_once(url: str, bodies: dict, timeout_s: float) -> dict:
    """Send every body at once (a thread each); {key: answer} of those answered by ``timeout_s``."""
    out: dict = {}
    threads = [
        threading.Thread(target=lambda k=k, b=b: out.__setitem__(k, answer(url, b, timeout_s)), daemon=True)
        for k, b in bodies.items()
    ]
    end = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, end - time.monotonic()))
    return dict(out)


def drop_stream(url: str, body: dict) -> str:
    """Send a streamed completion, read until the first event, close the connection."""
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        c.request(
            "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        r = c.getresponse()
        first = r.read1(4096) if hasattr(r, "read1") else r.read(64)
        return f"HTTP {r.status}, first {len(first)} bytes, then closed"
    finally:
        c.close()  # the client goes away mid-stream


def wait_idle(servers: list[Server], timeout_s: float = 15.0) -> dict:
    """Each server's ``vllm:kv_cache_usage_perc`` once 0 (or its last value after ``timeout_s``)."""
    end = time.monotonic() + timeout_s
    last: dict = {}
    while True:
        last = {s.name: kv_usage(s.url) for s in servers}
        if all(v == 0.0 for v in last.values()) or time.monotonic() > end:
            return last
        time.sleep(0.5)
