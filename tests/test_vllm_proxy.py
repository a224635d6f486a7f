"""The P/D proxy against two fake OpenAI-style servers on localhost (no vLLM)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvxfer.ports import free_port_base
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

    return _Fake(("127.0.0.1", 0), H)


class _Fake(ThreadingHTTPServer):
    request_queue_size = 512  # the upstreams take a burst too (test_proxy_takes_a_burst_of_clients)
    daemon_threads = True


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
def test_proxy_reports_a_failed_prefill(servers, caplog):
    port, _, seen_d, _ = servers
    with caplog.at_level("WARNING", logger="kvxfer.vllm.proxy"):
        status, data = _post(port, "/v1/completions", {"prompt": "hi"})
    assert status == 502 and b"answered 500" in data and b"boom" in data
    assert seen_d == []
    assert "prefill server 127.0.0.1:" in caplog.text and "answered 500" in caplog.text


def test_proxy_refuses_what_d_would_refuse_before_prefilling(servers, caplog):
    """n > 1 with greedy sampling: D (vLLM) refuses it, so P must not prefill it (its blocks
    would be held until the lease ends); the client gets a 400 naming the reason."""
    port, seen_p, seen_d, _ = servers
    with caplog.at_level("WARNING", logger="kvxfer.vllm.proxy"):
        status, data = _post(port, "/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0})
    assert status == 400 and b"n=2 with greedy sampling" in data
    assert seen_p == [] and seen_d == [] and "refused a request before prefilling" in caplog.text
    status, _ = _post(port, "/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0.7})
    assert status == 200 and len(seen_p) == 1  # sampling: P prefills it once
    # a client's kv_transfer_params that are not an object: a 400 naming it (it dropped the connection)
    status, data = _post(port, "/v1/completions", {"prompt": "hi", "kv_transfer_params": [1]})
    assert status == 400 and b"kv_transfer_params must be a JSON object, got list" in data
    assert len(seen_p) == 1


def _serve_all(*servers):
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    return threads


def _stop_all(servers, threads):
    for s in servers:
        s.shutdown()
        s.server_close()
    for t in threads:
        t.join(5)


def _fake_answers(p_answer: dict, d_status: int, d_body: bytes, d_ctype: str, seen: list):
    """A P answering ``p_answer`` and a D answering ``d_status`` with ``d_body`` (``d_ctype``)."""

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.server.name, body))
            if self.server.name == "P":
                status, data, ctype = 200, json.dumps(p_answer).encode(), "application/json"
            else:
                status, data, ctype = d_status, d_body, d_ctype
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    p, d = ThreadingHTTPServer(("127.0.0.1", 0), H), ThreadingHTTPServer(("127.0.0.1", 0), H)
    p.name, d.name = "P", "D"
    return p, d


def test_proxy_sends_d_a_request_p_did_not_hand_off(caplog):
    """P answers 200 without kv_transfer_params (it did not export: a sliding-window model, a
    connector that refused): D computes the prompt itself, and the proxy says so."""
    seen: list = []
    p, d = _fake_answers(
        {"choices": [{"text": "x"}]}, 200, b'{"choices": [{"text": "d"}]}', "application/json", seen
    )
    px = make_server(
        "127.0.0.1", 0, [f"http://127.0.0.1:{p.server_port}"], [f"http://127.0.0.1:{d.server_port}"], 10
    )
    threads = _serve_all(p, d, px)
    try:
        with caplog.at_level("WARNING", logger="kvxfer.vllm.proxy"):
            status, data = _post(px.server_port, "/v1/completions", {"prompt": "hi", "max_tokens": 5})
        assert status == 200 and json.loads(data) == {"choices": [{"text": "d"}]}
        assert seen[1] == ("D", {"prompt": "hi", "max_tokens": 5})
        assert "answered without kv_transfer_params" in caplog.text
    finally:
        _stop_all((p, d, px), threads)


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_names_a_dead_p_when_d_fails_the_load(stream, caplog):
    """D answers vLLM's bare "Internal server error" (a 500, or a streamed error event) for a
    request whose P is gone: the client's error and the proxy's log say which P and that its
    side channel refuses connections, at once."""
    dead = free_port_base(1)
    kv = {"request_id": "r1", "engine_id": "eng-P", "host": "127.0.0.1", "port": dead}
    err = {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}
    if stream:
        d_body = b'data: {"choices": []}\n\ndata: ' + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
        d_status, ctype = 200, "text/event-stream"
    else:
        d_body, d_status, ctype = json.dumps(err).encode(), 500, "application/json"
    seen: list = []
    p, d = _fake_answers({"kv_transfer_params": kv}, d_status, d_body, ctype, seen)
    p_url = f"http://127.0.0.1:{p.server_port}"
    px = make_server("127.0.0.1", 0, [p_url], [f"http://127.0.0.1:{d.server_port}"], 10)
    threads = _serve_all(p, d, px)
    try:
        with caplog.at_level("WARNING", logger="kvxfer.vllm.proxy"):
            t0 = time.monotonic()
            status, data = _post(px.server_port, "/v1/completions", {"prompt": "hi", "stream": stream})
            dt = time.monotonic() - t0
        assert dt < 1.0
        assert status == d_status
        if stream:
            events = data.split(b"\n\n")
            assert events[0] == b'data: {"choices": []}' and events[2] == b"data: [DONE]", data
            msg = json.loads(events[1][6:])["error"]["message"]
        else:
            msg = json.loads(data)["error"]["message"]
        assert msg.startswith("Internal server error [proxy: prefill server " + p_url), msg
        for part in ("eng-P", f"127.0.0.1:{dead}", "refuses connections", "request r1"):
            assert part in msg and part in caplog.text, (part, msg)
    finally:
        _stop_all((p, d, px), threads)


def test_proxy_client_dropping_a_stream_is_logged_not_a_traceback(caplog):
    """A client that goes away mid-stream: the proxy logs one line and carries on (no
    BrokenPipeError traceback from the server's error handler)."""
    import socket

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


def test_proxy_takes_a_burst_of_clients(servers):
    """128 clients at once all get their answer (the listen backlog was socketserver's 5: some of
    32 were reset by the kernel)."""
    port = servers[0]
    n = 128
    out: list = []
    go = threading.Barrier(n)

    def one():
        go.wait(30)
        try:
            out.append(_post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0])
        except OSError as e:
            out.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == [200] * n, [x for x in out if x != 200][:3]
