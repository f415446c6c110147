"""One keep-alive engine connection (router/engines/http11.py's pool holds them): an asyncio
Protocol feeding httptools' response parser, one response at a time, with exact framing.

The connection takes back exactly one response per request. Bytes nobody asked for (on an
idle connection, after the response ended) are never parsed; a second message beginning
in the same read stops the parser in its message-begin callback, before any of its headers
(the response before it stands when complete). Each such connection is closed and its
reason told to the pool's discard listener. `await_end` waits, without the caller, for the
end of a body the caller needs no more of (an SSE stream at its `[DONE]`).

Failures are the client's small tree, defined here and re-exported by http11.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable

import httptools

__all__ = ["DISCARD_REASONS", "BadResponse", "ConnectFailed", "Connection", "DiscardListener",
           "Dropped", "HTTPClientError", "InvalidHeader", "expire", "wake"]

_HIGH_WATER = 256 * 1024  # buffered body bytes before the socket stops being read
_INLINE_BODY = 64 * 1024  # bodies up to this size go out in the same write as the headers
_MAX_HEAD = 64 * 1024  # status line and headers: an engine sending more is not HTTP we take
# Why a connection was closed for its bytes (the discard listener's labels).
DISCARD_REASONS = (
    "idle_bytes",  # bytes arrived on an idle pooled connection
    "extra_message",  # a second message (or its head) followed the response in one read
    "bytes_after_end",  # bytes arrived after the response ended, before it was released
    "sse_after_done",  # an SSE body went on after `[DONE]`, or did not end in time
    "invalid_response",  # httptools refused the bytes (no HTTP/1.x framing it accepts)
)
DiscardListener = Callable[[str], None]


class HTTPClientError(Exception):
    """A transport failure talking to an engine."""


class ConnectFailed(HTTPClientError):
    """No connection could be opened (refused, DNS, no route, TLS handshake)."""


class Dropped(HTTPClientError):
    """The connection closed or reset before the response was complete."""


class BadResponse(HTTPClientError):
    """The peer's bytes are not an HTTP/1.x response."""


class InvalidHeader(HTTPClientError, ValueError):
    """A request header value holds a line break or NUL (it would split the request)."""


class _SecondMessage(Exception):
    """Raised from the parser's message-begin callback to stop it at a second message."""


def wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time (httptools callbacks)."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_lost: Callable[[Connection], None], on_discard: DiscardListener) -> None:
        self._loop = loop
        self._on_lost = on_lost
        self._on_discard = on_discard
        # While a finished body's end is awaited (`await_end`): told whether it is reusable.
        self._then: Callable[[bool], None] | None = None
        self._end_timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.busy = False  # a request is out and its response is being read
        self.got_bytes = False  # any byte of the current response arrived
        self._head_bytes = 0  # bytes received before the headers were complete
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.headers_done = False
        self.done = False  # the response's body is complete
        self.keep_alive = False  # the server keeps the connection open after it
        self.error: HTTPClientError | None = None
        self._second = False  # a second message began after this response
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small SSE writes and leg requests must not wait for Nagle.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.done:
            # Bytes nobody asked for (a late or extra answer): never parsed, since the next
            # request on this connection would take them for its response.
            self.discard("bytes_after_end" if self.busy else "idle_bytes")
            return
        self.got_bytes = True
        if not self.headers_done:
            self._head_bytes += len(data)
            if self._head_bytes > _MAX_HEAD + len(data):  # this read may carry the body
                self._fail(BadResponse(f"response headers over {_MAX_HEAD} bytes"))
                self.close()
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._second:  # the response before it was complete and stands
                self.discard("extra_message")
                return
            self._fail(BadResponse(f"invalid HTTP response: {exc}") if not self.headers_done
                       else Dropped(f"invalid response body: {exc}"))
            self.discard("invalid_response")
            return
        if self._then is not None and self.done:  # the awaited end came, nothing after it
            self._settle(self.reusable())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy and not self.done and self.error is None:
            if self.headers_done and self._reads_to_close():
                self.done = True  # a body without length ends with the connection
            else:
                why = f": {exc!r}" if exc is not None else ""
                self.error = Dropped(f"connection closed before the response was "
                                     f"complete{why}")
        wake(self._waiter)
        self._settle(False)
        self._on_lost(self)

    def pause_writing(self) -> None:  # the transport buffers a large body meanwhile
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.done:  # stop the parser before it takes a second message's headers
            self._second = True
            raise _SecondMessage

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.headers_done:  # trailers never change the response's headers
            self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        status: int = self._parser.get_status_code()
        if 100 <= status < 200:  # interim (100 Continue): the real response follows
            self.headers = {}
            return
        self.status = status
        self.headers_done = True
        wake(self._waiter)

    def on_body(self, body: bytes) -> None:
        if self._then is not None:  # the caller had all it wanted: more is a fault
            self.discard("sse_after_done")
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        wake(self._waiter)

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.done = True
            # Asked now: once the callback returns the parser resets for the next message.
            self.keep_alive = self._parser.should_keep_alive()
            wake(self._waiter)

    # -- used by the pool and `Response`
    def _reads_to_close(self) -> bool:
        h = self.headers
        return b"content-length" not in h and b"chunked" not in h.get(
            b"transfer-encoding", b"").lower()

    def discard(self, reason: str) -> None:
        """Close the connection for its bytes, counted once."""
        if not self.closed:
            self._on_discard(reason)
        self.close()
        self._settle(False)

    def await_end(self, grace_s: float, then: Callable[[bool], None]) -> None:
        """The caller has all it wants of the body: `then(reusable)` once the body ends
        with no further byte (True), or at the first body byte, a drop or `grace_s`
        (False; the connection is closed)."""
        self._then = then
        self._end_timer = self._loop.call_later(grace_s, self.discard, "sse_after_done")

    def _settle(self, reusable: bool) -> None:
        then, self._then = self._then, None
        if self._end_timer is not None:
            self._end_timer.cancel()
            self._end_timer = None
        if then is not None:
            then(reusable)

    def has_body(self) -> bool:
        """Body bytes arrived that nobody read yet."""
        return bool(self._body)

    def _fail(self, error: HTTPClientError) -> None:
        if self.error is None:
            self.error = error
        wake(self._waiter)

    def send(self, data: bytes, body: bytes | None) -> None:
        if self.closed or self._transport is None or self._transport.is_closing():
            raise Dropped("connection closed before the request was sent")
        self._reset()
        self.busy = True
        if body is None or len(body) <= _INLINE_BODY:
            self._transport.write(data + body if body else data)
        else:
            self._transport.writelines((data, body))

    async def wait(self, deadline: float | None) -> None:
        """Until the parser made progress, the connection ended or `deadline` passed."""
        fut = self._waiter = self._loop.create_future()
        timer = self._loop.call_at(deadline, expire, fut) if deadline is not None else None
        try:
            await fut
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def read_headers(self, deadline: float | None) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            if self.closed:
                raise Dropped("connection closed before the response was complete")
            await self.wait(deadline)

    def take_body(self) -> bytes:
        """Everything buffered of the body (b"" when nothing is)."""
        body = self._body
        if not body:
            return b""
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return data

    async def read_some(self, deadline: float | None) -> bytes:
        """The next body bytes (whatever has arrived), b"" once the body is complete."""
        while True:
            if self._body:
                return self.take_body()
            if self.done:
                return b""
            if self.error is not None:
                raise self.error
            if self.closed:
                raise Dropped("connection closed before the response was complete")
            await self.wait(deadline)

    def reusable(self) -> bool:
        """The parser ended exactly at the end of a keep-alive response, all of it read."""
        return (self.done and self.keep_alive and not self._body and self.error is None
                and not self._second and not self.closed)

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()
