"""A small disaggregation proxy: prefill on P, hand ``kv_transfer_params`` to D, answer from D.

    python -m kvxfer.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For ``POST /v1/completions`` and ``POST /v1/chat/completions`` it sends the request to P with
``max_tokens=1``, ``n=1``, no streaming and ``kv_transfer_params={"do_remote_decode": true}``,
takes the ``kv_transfer_params`` of P's response and sends the original request to D with
them, then relays D's answer (streamed or not) to the client. Any other path goes to D
unchanged. With several ``--prefill``/``--decode`` servers it picks them round robin.

Standard library only; meant for trying the connector and for tests, not for production
traffic (one thread per connection, no retries). Every upstream call has a timeout.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_LOG = logging.getLogger(__name__)

__all__ = ["make_server", "prefill_body"]

_GENERATE = ("/v1/completions", "/v1/chat/completions")


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
    host: str, port: int, prefill: list[str], decode: list[str], timeout_s: float = 600.0
) -> ThreadingHTTPServer:
    """A ready (not yet serving) proxy; call ``serve_forever()`` and ``shutdown()``."""
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

        def _relay(self, u, method: str, path: str, body: bytes | None) -> None:
            c = _conn(u, timeout_s)
            try:
                self._relay_on(c, method, path, body)
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

        def _relay_on(self, c, method: str, path: str, body: bytes | None) -> None:
            """Send one upstream request on ``c`` and stream its answer to the client (chunked)."""
            headers = {"Content-Type": "application/json"} if body is not None else {}
            auth = self.headers.get("Authorization")
            if auth:
                headers["Authorization"] = auth
            try:
                c.request(method, path, body=body, headers=headers)
                r = c.getresponse()
            except OSError as e:
                self._reply(502, {"error": f"proxy: upstream {c.host}:{c.port}: {e}"})
                return
            self.send_response(r.status)
            ctype = r.getheader("Content-Type", "application/json")
            self.send_header("Content-Type", ctype)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                chunk = r.read1(65536)
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

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
                self._reply(502, {"error": f"proxy: prefill server {p_url.netloc}: {e}"})
                return
            finally:
                c.close()
            try:
                kv = json.loads(p_raw).get("kv_transfer_params") if status == 200 else None
            except ValueError:
                kv = None
            if not kv:
                _LOG.warning(
                    "proxy: prefill server %s answered %d without kv_transfer_params", p_url.netloc, status
                )
                self._reply(502, {"error": f"proxy: prefill server {p_url.netloc} answered {status} "
                                           f"without kv_transfer_params: {p_raw[:500]!r}"})  # fmt: skip
                return
            body["kv_transfer_params"] = kv
            self._relay(d_url, "POST", self.path, json.dumps(body).encode())

    return ThreadingHTTPServer((host, port), Handler)


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
