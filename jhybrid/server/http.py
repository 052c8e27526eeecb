"""HTTP plumbing of the server: body limits and read timeouts, the JSON content type, API keys, OpenAI-style
error responses, server-sent events, client-disconnect detection and per-route HTTP counters."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

import anyio
import h11
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from jhybrid.server.protocol import APIError

_DRAIN_LIMIT = 16 << 20  # read (and drop) at most this much of an oversized body so the client sees the 413


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    return JSONResponse(e.body(), status_code=e.status, headers={**headers, **(e.headers or {})})


def require_json(request: Request) -> None:
    """415 unless the body is declared `Content-Type: application/json` (parameters such as charset allowed).
    Browsers send other types (text/plain, forms) cross-origin without a CORS preflight; this refuses them."""
    declared = request.headers.get("content-type", "")
    if declared.split(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, got {declared or 'none'!r}",
                       code="unsupported_media_type")


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless `Authorization: Bearer <api_key>` (when a key is set)."""
    if not api_key:
        return
    header = request.headers.get("authorization")
    if header is None:
        raise APIError(401, "missing API key: send the header `Authorization: Bearer <key>`", code="missing_api_key")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The request body; 413 when its Content-Length or its actual size exceeds `limit` bytes, 408 when it has
    not arrived whole within `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"invalid Content-Length header {declared!r}", code="invalid_request")
        if int(declared) > limit:
            if int(declared) <= _DRAIN_LIMIT:
                await _drain(request)
            raise APIError(413, f"the request body ({int(declared)} bytes) exceeds the server's limit of {limit} bytes",
                           code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request, size)
            raise APIError(413, f"the request body exceeds the server's limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request: Request, size: int = 0) -> None:
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > _DRAIN_LIMIT:
                return
    except Exception:  # noqa: BLE001 - the client went away or the stream was consumed: nothing to drain
        return


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, coro) -> Any:
    """Awaits `coro`; if the client disconnects first, cancels it and raises ClientDisconnected."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientDisconnected()
    finally:
        for task in (work, watcher):
            task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """A server-sent-event response that always closes its generator, so the generator's `finally` (which
    aborts the request) runs whether the stream ends, the client disconnects, or the server cancels it."""

    media_type = "text/event-stream"

    def __init__(self, content, *, on_close=None, **kwargs):
        self.on_close = on_close  # also runs when the generator never started
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away while we wrote
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            if self.on_close is not None:
                self.on_close()


class HTTPMetricsMiddleware:
    """Counts responses by method, route (known routes only, to bound label cardinality) and status."""

    def __init__(self, app, counter, routes: frozenset[str]):
        self.app, self.counter, self.routes = app, counter, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_record(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.counter.labels(scope["method"], route, str(status)).inc()


_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: 38\r\n\r\nrequest headers not received in time\r\n")


def header_timeout_protocol(seconds: float, *, prefer: str = "httptools") -> type:
    """uvicorn's HTTP/1.1 protocol with a request-header read timeout: a connection whose request line and
    headers have not arrived whole within `seconds` of its first byte (or of connecting) gets 408 and is
    closed. uvicorn's own `timeout_keep_alive` covers idle connections between requests; the body timeout is
    `read_body`'s. The protocol is uvicorn's httptools one when httptools is installed (`prefer`), else its
    pure-Python h11 one: under a streaming load the h11 state machine cost more CPU per server-sent event
    than everything else the event loop does (benchmarks/RESULTS.md), and that CPU is taken from the engine
    thread under the GIL."""
    if prefer == "httptools":
        try:
            return _httptools_protocol(seconds)
        except ImportError:
            pass
    elif prefer != "h11":
        raise ValueError(f"unknown HTTP protocol {prefer!r}; choose 'httptools' or 'h11'")
    return _h11_protocol(seconds)


class _HeaderTimer:
    """The header timer of one connection (mixed into a uvicorn protocol: `loop`, `transport`)."""

    _header_timer = None

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self._header_seconds, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.write(_TIMEOUT_408)
            self.transport.close()


def _httptools_protocol(seconds: float) -> type:
    import httptools  # noqa: F401  (uvicorn's protocol needs it)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutHttpToolsProtocol(_HeaderTimer, HttpToolsProtocol):
        _header_seconds = seconds
        _in_headers = True  # from connecting until the first request's headers are complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:  # the first byte of a request
            self._in_headers = True
            self._arm()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self._in_headers

    return HeaderTimeoutHttpToolsProtocol


def _h11_protocol(seconds: float) -> type:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(_HeaderTimer, H11Protocol):
        _header_seconds = seconds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()  # a request is starting (or will, after this keep-alive's bytes)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE

    return HeaderTimeoutH11Protocol
