"""The P/D proxy against two fake OpenAI-style servers on localhost (no vLLM)."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvxfer.vllm.proxy import make_server, prefill_body


def _fake(kind: str, seen: list, stream_chunks=None, fail: bool = False) -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            if fail:
                data = b'{"error": "boom"}'
                self.send_response(500)
            elif kind == "P":
                data = json.dumps(
                    {"choices": [{"text": "x"}], "kv_transfer_params": {"request_id": "p1"}}
                ).encode()
                self.send_response(200)
            elif body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(sum(map(len, stream_chunks))))
                self.end_headers()
                for c in stream_chunks:
                    self.wfile.write(c)
                return
            else:
                data = json.dumps({"choices": [{"text": "decoded"}]}).encode()
                self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return ThreadingHTTPServer(("127.0.0.1", 0), H)


@pytest.fixture
def servers(request):
    fail = getattr(request, "param", False)
    seen_p, seen_d = [], []
    chunks = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
    p, d = _fake("P", seen_p, fail=fail), _fake("D", seen_d, chunks)
    px = make_server(
        "127.0.0.1", 0, [f"http://127.0.0.1:{p.server_port}"], [f"http://127.0.0.1:{d.server_port}"], 10
    )
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (p, d, px)]
    for t in threads:
        t.start()
    yield px.server_port, seen_p, seen_d, chunks
    for s in (p, d, px):
        s.shutdown()
        s.server_close()
    for t in threads:
        t.join(5)


def _post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_prefill_body():
    b = prefill_body({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "n": 3})
    assert b == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip


def test_proxy_hands_p_params_to_d(servers):
    port, seen_p, seen_d, _ = servers
    status, data = _post(port, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 20})
    assert status == 200 and json.loads(data) == {"choices": [{"text": "decoded"}]}
    assert seen_p[0][1]["max_tokens"] == 1 and seen_p[0][1]["kv_transfer_params"] == {
        "do_remote_decode": True
    }
    assert seen_d[0][1] == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 20,
        "kv_transfer_params": {"request_id": "p1"},
    }


def test_proxy_relays_a_stream(servers):
    port, _, seen_d, chunks = servers
    status, data = _post(
        port, "/v1/chat/completions", {"messages": [], "stream": True, "max_completion_tokens": 9}
    )
    assert status == 200 and data == b"".join(chunks)
    assert seen_d[0][1]["stream"] is True and seen_d[0][1]["max_completion_tokens"] == 9


@pytest.mark.parametrize("servers", [True], indirect=True)
def test_proxy_reports_a_failed_prefill(servers):
    port, _, seen_d, _ = servers
    status, data = _post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 502 and b"without kv_transfer_params" in data
    assert seen_d == []


def test_proxy_client_dropping_a_stream_is_logged_not_a_traceback(caplog):
    """A client that goes away mid-stream: the proxy logs one line and carries on (no
    BrokenPipeError traceback from the server's error handler)."""
    import socket
    import time

    chunks = [b'data: {"i": %d}\n\n' % i for i in range(40)]

    class SlowD(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(sum(map(len, chunks))))
            self.end_headers()
            try:
                for c in chunks:
                    self.wfile.write(c)
                    self.wfile.flush()
                    time.sleep(0.02)
            except OSError:
                pass  # the proxy closed its upstream connection

    p, d = _fake("P", []), ThreadingHTTPServer(("127.0.0.1", 0), SlowD)
    px = make_server(
        "127.0.0.1", 0, [f"http://127.0.0.1:{p.server_port}"], [f"http://127.0.0.1:{d.server_port}"], 10
    )
    errors = []
    px.handle_error = lambda request, addr: errors.append(addr)  # where a traceback would come from
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (p, d, px)]
    for t in threads:
        t.start()
    try:
        body = json.dumps({"prompt": "hi", "stream": True}).encode()
        with caplog.at_level("INFO", logger="kvxfer.vllm.proxy"):
            s = socket.create_connection(("127.0.0.1", px.server_port), timeout=10)
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            assert s.recv(64)  # the stream started
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()  # reset: the proxy's next write fails
            deadline = time.monotonic() + 5
            while "connection closed while relaying" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "connection closed while relaying POST /v1/completions" in caplog.text
        assert errors == []
        status, _ = _post(px.server_port, "/v1/completions", {"prompt": "again"})  # still serving
        assert status == 200
    finally:
        for srv in (p, d, px):
            srv.shutdown()
            srv.server_close()
        for t in threads:
            t.join(5)
