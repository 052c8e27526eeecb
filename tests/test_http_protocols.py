"""The server's HTTP/1.1 protocols (jhybrid/server/http.py): uvicorn's httptools protocol by default, its h11
one as the fallback, both with the request-header read timeout. Each is served from a thread on a bare ASGI
app that streams chunks, so the protocol's own behaviour is all that is tested."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from jhybrid.server.http import header_timeout_protocol


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(3):
        await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture(params=["httptools", "h11"])
def server(request):
    protocol = header_timeout_protocol(0.5, prefer=request.param)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(_app, http=protocol, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield request.param, protocol, sock.getsockname()[1]
    srv.should_exit = True
    thread.join(10)


def _exchange(port: int, data: bytes, wait: float = 0.0) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        t0 = time.monotonic()
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
            if wait and b"0\r\n\r\n" in reply:  # the whole chunked body: hold the keep-alive connection
                time.sleep(wait)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # a second request whose headers stall
                wait = 0.0
        return reply, time.monotonic() - t0


def test_the_protocol_asked_for_serves_the_stream(server):
    """The default is the httptools protocol (the fallback only when httptools is missing), and both stream
    every chunk of a chunked response."""
    name, protocol, port = server
    assert protocol.__mro__[2].__name__ == {"httptools": "HttpToolsProtocol", "h11": "H11Protocol"}[name]
    reply, _ = _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200")
    assert all(f"data: {i}\n\n".encode() in reply for i in range(3)), reply


@pytest.mark.parametrize("data", [b"", b"GET / HTTP/1.1\r\nHost: x\r\nAccept: te"], ids=["nothing", "half headers"])
def test_headers_that_do_not_arrive_get_408(server, data):
    """A connection that sends nothing, or stops inside its headers, gets 408 and is closed after the header
    timeout (0.5 s). Checked to fail with `_arm` made a no-op (the read waits for the 10 s socket timeout)."""
    _, _, port = server
    reply, took = _exchange(port, data)
    assert reply.startswith(b"HTTP/1.1 408") and took < 5, (reply[:80], took)


def test_a_keep_alive_request_whose_headers_stall_gets_408(server):
    """After a complete response on a keep-alive connection, the next request's headers are timed from its first
    byte: a stalled second request gets 408 (the first response is whole before it)."""
    _, _, port = server
    reply, took = _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", wait=0.7)
    assert reply.startswith(b"HTTP/1.1 200") and b"data: 2\n\n" in reply
    assert reply.count(b"HTTP/1.1 408") == 1 and took < 5, (reply[-120:], took)
