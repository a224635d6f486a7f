"""A small disaggregation proxy: prefill on P, hand ``kv_transfer_params`` to D, answer from D.

    python -m kvxfer.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For ``POST /v1/completions`` and ``POST /v1/chat/completions`` it sends the request to P with
``max_tokens=1``, ``n=1``, no streaming and ``kv_transfer_params={"do_remote_decode": true}``,
takes the ``kv_transfer_params`` of P's response and sends the original request to D with
them, then relays D's answer (streamed or not) to the client. Any other path goes to D
unchanged. With several ``--prefill``/``--decode`` servers it picks them round robin.

What goes wrong is said to the client and logged (a warning): a request D would refuse
(``n > 1`` with greedy sampling) is answered 400 before P prefills it (P would hold its KV
until the lease ends); a P that cannot be reached, or answers an error, is a 502 naming it; a
P that answers without ``kv_transfer_params`` (it did not hand the KV off: its log says why)
sends the request to D without them, to compute itself; when D answers an error (vLLM says
"Internal server error" for a failed KV load, as a 500 or as a streamed error event) the
proxy checks P's side channel (a TCP connect, 0.1 s at most) and adds to the error which P
(URL, engine id, side-channel address) and what it found: P refusing connections (gone), or
P alive (D's log has the load's reason).

Standard library only; meant for trying the connector and for tests, not for production
traffic (one thread per connection, no retries). Every upstream call has a timeout.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_LOG = logging.getLogger(__name__)

__all__ = ["make_server", "prefill_body", "refusal"]

_GENERATE = ("/v1/completions", "/v1/chat/completions")
_GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS (sampling_params.py): a lower temperature is greedy
_PROBE_S = 0.1  # bound of the check of P's side channel after D failed
_ERROR_BODY_MAX = 1 << 20


def refusal(body: dict) -> str:
    """Why D would refuse ``body`` before running it (so P must not prefill it), or ``""``:
    ``kv_transfer_params`` that are not an object, ``n > 1`` with greedy sampling, which vLLM rejects ("n must be 1 when using greedy
    sampling"). Only what the request says is checked (a model whose generation config makes
    greedy the default is not known here)."""
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        return f"kv_transfer_params must be a JSON object, got {type(kv).__name__}"
    n, t = body.get("n", 1), body.get("temperature")
    greedy = isinstance(t, (int, float)) and not isinstance(t, bool) and t < _GREEDY_EPS
    if isinstance(n, int) and not isinstance(n, bool) and n > 1 and greedy:
        return f"n={n} with greedy sampling (temperature {t}): vLLM takes n > 1 only when sampling"
    return ""


def probe_p(p_url: str, kv: dict) -> str:
    """What the side channel of the P that made ``kv`` (its ``kv_transfer_params``) says, in
    words for the client: refusing connections (P is gone), silent, or accepting them (P is
    alive: D's log says why the load failed). One TCP connect, at most ``_PROBE_S``."""
    host, port = kv.get("host"), kv.get("port")
    who = f"prefill server {p_url} (kvxfer engine {kv.get('engine_id')}, side channel {host}:{port})"
    rid = kv.get("request_id")
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
        return f"{who}: its params name no side channel"
    try:
        with socket.create_connection((host, port), timeout=_PROBE_S):
            pass
    except ConnectionRefusedError:
        return f"{who} refuses connections: P is gone, so D could not load request {rid}'s KV from it"
    except OSError as e:
        return f"{who} did not answer a connection in {_PROBE_S} s ({e}): D could not load request {rid}'s KV"
    return f"{who} accepts connections: D's log says why the load of request {rid} failed"


def _annotate(data: bytes, note: str) -> bytes:
    """An OpenAI-style error body (``{"error": {"message": ...}}`` or ``{"error": "..."}``) with
    `` [proxy: note]`` added to its message; any other body with the note after it."""
    try:
        d = json.loads(data)
    except ValueError:
        d = None
    if isinstance(d, dict) and isinstance(d.get("error"), dict):
        err = d["error"]
        err["message"] = f"{err.get('message', '')} [proxy: {note}]"
    elif isinstance(d, dict) and isinstance(d.get("error"), str):
        d["error"] = f"{d['error']} [proxy: {note}]"
    else:
        return data + f" [proxy: {note}]".encode()
    return json.dumps(d).encode()


def prefill_body(body: dict) -> dict:
    """The request sent to P: one token, one choice, no streaming, asking P to hold the KV."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), "do_remote_decode": True}
    return out


class _Upstreams:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        if not prefill or not decode:
            raise ValueError("proxy: needs at least one --prefill and one --decode server")
        self._p = itertools.cycle([urllib.parse.urlsplit(u) for u in prefill])
        self._d = itertools.cycle([urllib.parse.urlsplit(u) for u in decode])
        self._lock = threading.Lock()

    def next(self) -> tuple[urllib.parse.SplitResult, urllib.parse.SplitResult]:
        with self._lock:
            return next(self._p), next(self._d)


def _conn(u: urllib.parse.SplitResult, timeout: float) -> http.client.HTTPConnection:
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout)


def make_server(
    host: str,
    port: int,
    prefill: list[str],
    decode: list[str],
    timeout_s: float = 600.0,
    after_prefill: Callable[[str, dict], None] | None = None,
) -> ThreadingHTTPServer:
    """A ready (not yet serving) proxy; call ``serve_forever()`` and ``shutdown()``.

    ``after_prefill(p_url, kv_transfer_params)``: called once P answered with its params, before
    the request goes to D (a test hook: ``tests/vllm_served.py`` kills P there)."""
    ups = _Upstreams(prefill, decode)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # route to logging, not stderr
            _LOG.debug("proxy: " + fmt, *args)

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _relay(self, u, method: str, path: str, body: bytes | None, failed=None) -> None:
            c = _conn(u, timeout_s)
            try:
                self._relay_on(c, method, path, body, failed)
            except (BrokenPipeError, ConnectionResetError) as e:  # the client went away mid-answer
                _LOG.info(
                    "proxy: connection closed while relaying %s %s to client %s (%s)",
                    method,
                    path,
                    self.client_address[0],
                    e,
                )
                self.close_connection = True
            finally:
                c.close()

        def _relay_on(self, c, method: str, path: str, body: bytes | None, failed=None) -> None:
            """Send one upstream request on ``c`` and stream its answer to the client (chunked).
            ``failed(status) -> note``: for D's answer to a handed-off request, called when it
            is an error (a status >= 500, or a streamed error event): the note is added to the
            error's message."""
            headers = {"Content-Type": "application/json"} if body is not None else {}
            auth = self.headers.get("Authorization")
            if auth:
                headers["Authorization"] = auth
            try:
                c.request(method, path, body=body, headers=headers)
                r = c.getresponse()
            except OSError as e:
                _LOG.warning("proxy: upstream %s:%s: %s (502 to the client)", c.host, c.port, e)
                self._reply(502, {"error": f"proxy: upstream {c.host}:{c.port}: {e}"})
                return
            ctype = r.getheader("Content-Type", "application/json")
            if failed is not None and r.status >= 400:
                data = failed(r.status, r.read(_ERROR_BODY_MAX))
                self.send_response(r.status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(r.status)
            self.send_header("Content-Type", ctype)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = failed is not None and ctype.startswith("text/event-stream")
            buf = b""
            while True:
                chunk = r.read1(65536)
                if not chunk:
                    break
                if events:  # whole events only, an error event annotated
                    buf += chunk
                    cut = buf.rfind(b"\n\n") + 2
                    if cut < 2:
                        continue
                    chunk, buf = buf[:cut], buf[cut:]
                    if b'"error"' in chunk:
                        chunk = b"".join(self._event(ev, failed) for ev in chunk.split(b"\n\n")[:-1])
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            if buf:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(buf), buf))
            self.wfile.write(b"0\r\n\r\n")

        @staticmethod
        def _event(ev: bytes, failed) -> bytes:
            """One server-sent event (without its blank line), an error event annotated."""
            if ev.startswith(b"data: {") and b'"error"' in ev:
                try:
                    is_error = "error" in json.loads(ev[6:])
                except ValueError:
                    is_error = False
                if is_error:
                    ev = b"data: " + failed(200, ev[6:])
            return ev + b"\n\n"

        def do_GET(self) -> None:
            self._relay(ups.next()[1], "GET", self.path, None)

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            p_url, d_url = ups.next()
            if self.path not in _GENERATE:
                self._relay(d_url, "POST", self.path, raw)
                return
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("request body must be a JSON object")
            except ValueError as e:
                self._reply(400, {"error": f"proxy: bad request body: {e}"})
                return
            why = refusal(body)
            if why:
                _LOG.warning("proxy: refused a request before prefilling it: %s", why)
                self._reply(400, {"error": f"proxy: {why}"})
                return
            c = _conn(p_url, timeout_s)
            try:
                c.request(
                    "POST",
                    self.path,
                    body=json.dumps(prefill_body(body)),
                    headers={"Content-Type": "application/json"},
                )
                r = c.getresponse()
                p_raw = r.read()
                status = r.status
            except OSError as e:
                _LOG.warning("proxy: prefill server %s: %s (502 to the client)", p_url.netloc, e)
                self._reply(502, {"error": f"proxy: prefill server {p_url.netloc}: {e}"})
                return
            finally:
                c.close()
            try:
                answer = json.loads(p_raw) if status == 200 else None
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                _LOG.warning("proxy: prefill server %s answered %d (502 to the client)", p_url.netloc, status)
                self._reply(502, {"error": f"proxy: prefill server {p_url.netloc} answered {status}: "
                                           f"{p_raw[:500]!r}"})  # fmt: skip
                return
            kv = answer.get("kv_transfer_params")
            if not isinstance(kv, dict) or not kv:
                _LOG.warning(
                    "proxy: prefill server %s answered without kv_transfer_params (it did not hand the "
                    "KV off: its log says why); the decode server %s computes the prompt itself",
                    p_url.netloc,
                    d_url.netloc,
                )
                body.pop("kv_transfer_params", None)
                self._relay(d_url, "POST", self.path, json.dumps(body).encode())
                return
            if after_prefill is not None:
                after_prefill(p_url.geturl(), kv)
            body["kv_transfer_params"] = kv
            p_name, d_name = p_url.geturl(), d_url.netloc

            def failed(status: int, data: bytes) -> bytes:
                if status >= 500 or status == 200:  # 200: an error event in a stream
                    note = probe_p(p_name, kv)
                    _LOG.warning("proxy: decode server %s failed a request (%d): %s", d_name, status, note)
                    return _annotate(data, note)
                _LOG.warning(
                    "proxy: decode server %s refused a request (%d: %r); prefill server %s holds its KV "
                    "(request %s) until its lease ends",
                    d_name, status, data[:300], p_name, kv.get("request_id"),
                )  # fmt: skip
                return data

            self._relay(d_url, "POST", self.path, json.dumps(body).encode(), failed)

    return _Server((host, port), Handler)


class _Server(ThreadingHTTPServer):
    # connections waiting to be accepted (socketserver's default is 5: a burst of 32 clients
    # had some reset by the kernel before a thread took them)
    request_queue_size = 512
    daemon_threads = True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="kvxfer P/D disaggregation proxy for vLLM servers")
    ap.add_argument("--prefill", action="append", required=True, help="P server URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="D server URL (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    srv = make_server(a.host, a.port, a.prefill, a.decode, a.timeout)
    _LOG.info("kvxfer proxy on %s:%d: prefill %s, decode %s", a.host, a.port, a.prefill, a.decode)
    try:
        srv.serve_forever()
    finally:
        srv.server_close()


if __name__ == "__main__":
    main()
