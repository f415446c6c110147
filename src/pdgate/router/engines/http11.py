"""A lean pooled HTTP/1.1 client for the engine legs: asyncio Protocols + httptools' parser.

Why not aiohttp: profiled behind instant engines, aiohttp's client was ~40% of the router's
CPU per request (two small POSTs: request and response objects, header multidicts, timer
objects, payload registry, stream readers). This client does only what `engines.py` needs:
one request at a time per connection, keep-alive connections pooled per origin, bodies
sent with Content-Length, responses with Content-Length, chunked or read-to-close bodies.
No redirects, no decompression, no cookies, no proxies: an engine URL is used as configured.

Failures are this module's own small tree (translated once, in `engines._translate`):
`ConnectFailed` (no connection could be opened: refused, DNS, no route, TLS), `Dropped`
(the connection closed or reset before the response was complete), `BadResponse` (not an
HTTP/1.x response), `InvalidHeader` (a header value that would split the request), and the
builtin `TimeoutError` for every deadline.

Deadlines are absolute `loop.time()` values; a wait arms one timer only when the data is
not already there (a small reply usually arrives with its headers in one read).

A reused keep-alive connection that the server closed just as a request went out (no byte
of a response came back, within `STALE_CLOSE_S` of sending) is retried once on a fresh
connection, as browsers and aiohttp do. A drop later than that is an engine that took the
request and died (or was killed) working on it: the request is not sent again behind the
caller's back (engine POSTs are not idempotent: a prefill would pin its blocks twice); the
flow's own retry and failover decide what happens next.

Framing is exact: a connection goes back to the pool only when its parser ended exactly at
the end of the response (nothing of a second message parsed) and no byte arrived since.
Bytes on an idle connection, a second message (or its head) after the response in the same
read, bytes after the response's end in a later read, or bytes httptools refuses close the
connection, counted by reason (`ConnectionPool.set_discard_listener`); the response they
followed stands when it was complete. Such bytes are never parsed as the next request's
response. (A late answer that reaches a connection after the next request went out on it
looks like that request's answer on the wire: the engine client's request-id check is
what refuses it.) `Response.finish` ends a body the caller needs no more of (an SSE
stream at its `[DONE]`): the connection is pooled only if the body then ends with no
further byte within `END_GRACE_S`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

__all__ = ["DISCARD_REASONS", "END_GRACE_S", "STALE_CLOSE_S", "BadResponse", "ConnectFailed",
           "ConnectionPool", "DiscardListener", "Dropped", "HTTPClientError", "InvalidHeader",
           "Response"]

_HIGH_WATER = 256 * 1024  # buffered body bytes before the socket stops being read
_INLINE_BODY = 64 * 1024  # bodies up to this size go out in the same write as the headers
_MAX_HEAD = 64 * 1024  # status line and headers: an engine sending more is not HTTP we take
# A keep-alive connection the server had already closed drops the request at once (its FIN
# crossed ours); later than this, the engine had the request.
STALE_CLOSE_S = 0.25
# After an SSE `[DONE]`, the body's end (the last chunk) follows at once from an engine that
# keeps to the protocol; one that has not ended it by then loses the connection.
END_GRACE_S = 1.0
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


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an engine URL's requests go; `prefix` is the URL's own path (no trailing /)."""

    host: str
    port: int
    tls: bool
    prefix: str
    host_header: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if tls else 80)
        default = port == (443 if tls else 80)
        shown = f"[{host}]" if ":" in host else host
        return cls(host, port, tls, parts.path.rstrip("/"),
                   shown if default else f"{shown}:{port}")


def _wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time (httptools callbacks)."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_lost: Callable[[_Connection], None], on_discard: DiscardListener) -> None:
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
        _wake(self._waiter)
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
        _wake(self._waiter)

    def on_body(self, body: bytes) -> None:
        if self._then is not None:  # the caller had all it wanted: more is a fault
            self.discard("sse_after_done")
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        _wake(self._waiter)

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.done = True
            # Asked now: once the callback returns the parser resets for the next message.
            self.keep_alive = self._parser.should_keep_alive()
            _wake(self._waiter)

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
        _wake(self._waiter)

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
        timer = self._loop.call_at(deadline, _expire, fut) if deadline is not None else None
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


class Response:
    """A response whose status line and headers arrived; read its body with `read_some`.
    `release()` once done: the connection goes back to the pool when the body was read to
    its end (and the server keeps it alive), else it is closed. `close()` always closes."""

    __slots__ = ("_conn", "_pool", "_origin", "status", "headers")

    def __init__(self, pool: ConnectionPool, origin: Origin, conn: _Connection) -> None:
        self._pool, self._origin = pool, origin
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers = conn.headers

    @property
    def content_length(self) -> int | None:
        raw = self.headers.get(b"content-length")
        return int(raw) if raw is not None and raw.isdigit() else None

    @property
    def content_type(self) -> str:
        """The media type, lower case, parameters dropped ("" when none)."""
        raw = self.headers.get(b"content-type", b"")
        return raw.split(b";", 1)[0].strip().lower().decode("latin-1")

    async def read_some(self, deadline: float | None) -> bytes:
        """The next body bytes as they arrive (b"" at the end); waits until `deadline`."""
        if self._conn is None:
            raise Dropped("the response was already released")
        return await self._conn.read_some(deadline)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(self._origin, conn, conn.reusable())

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(self._origin, conn, False)

    def finish(self, trailing: bool = False) -> None:
        """The caller has all it wants of the body (an SSE stream at its `[DONE]` event;
        `trailing`: it saw bytes after it). The connection goes back to the pool only if
        the body ends right there: no further body byte, and its end within `END_GRACE_S`
        (waited for without the caller); else it is closed, counted. Returns at once."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        pool, origin = self._pool, self._origin
        if trailing or conn.has_body():
            conn.discard("sse_after_done")
            pool.release(origin, conn, False)
        elif conn.done or conn.closed or conn.error is not None:
            pool.release(origin, conn, conn.reusable())
        else:
            conn.await_end(END_GRACE_S, lambda ok: pool.release(origin, conn, ok))


class ConnectionPool:
    """Keep-alive connections per origin. At most `limit` are in use at once (a request
    over that waits for one to come back); an idle one older than `keepalive_s` is closed
    instead of reused (set below the engines' own keep-alive, so the router drops idle
    connections before the engine does)."""

    def __init__(self, *, limit: int, keepalive_s: float,
                 auth_header: str | None = None) -> None:
        self._limit = limit
        self._keepalive_s = keepalive_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._in_use = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._extra = f"{auth_header}\r\n" if auth_header else ""
        self._closed = False
        self._tls: ssl.SSLContext | None = None
        self._discard_listener: DiscardListener | None = None

    def set_discard_listener(self, listener: DiscardListener | None) -> None:
        """Who hears the reason (one of `DISCARD_REASONS`) of each connection closed for
        bytes past its framing (a counter)."""
        self._discard_listener = listener

    def _discarded(self, reason: str) -> None:
        if self._discard_listener is not None:
            self._discard_listener(reason)

    def origin(self, url: str) -> Origin:
        found = self._origins.get(url)
        if found is None:
            found = self._origins[url] = Origin.parse(url)
        return found

    async def request(
        self, method: str, url: str, path: str, body: bytes | None,
        headers: Mapping[str, str], *, connect_deadline: float | None,
        deadline: float | None,
    ) -> Response:
        """Send one request and wait (until `deadline`) for its status line and headers.
        Opening a connection must also finish by `connect_deadline`."""
        origin = self.origin(url)
        head = self._head(method, origin, path, headers, body)
        loop = asyncio.get_running_loop()
        for _ in range(2):
            conn, reused = await self._acquire(origin, connect_deadline, deadline)
            sent = loop.time()
            try:
                conn.send(head, body)
                await conn.read_headers(deadline)
            except Dropped:
                self.release(origin, conn, False)
                if reused and not conn.got_bytes and loop.time() - sent < STALE_CLOSE_S:
                    continue  # the server closed this idle connection as the request left
                raise
            except BaseException:
                self.release(origin, conn, False)
                raise
            return Response(self, origin, conn)
        raise AssertionError("unreachable")

    def _head(self, method: str, origin: Origin, path: str, headers: Mapping[str, str],
              body: bytes | None) -> bytes:
        lines = [f"{method} {origin.prefix}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n",
                 self._extra]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\0" in value:
                raise InvalidHeader(f"header {name!r} holds a line break or NUL")
            lines.append(f"{name}: {value}\r\n")
        if body is not None:
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    async def _acquire(self, origin: Origin, connect_deadline: float | None,
                       deadline: float | None) -> tuple[_Connection, bool]:
        if self._closed:
            raise Dropped("the engine client is closed")
        loop = asyncio.get_running_loop()
        while self._in_use >= self._limit:
            fut: asyncio.Future[None] = loop.create_future()
            self._slot_waiters.append(fut)
            timer = loop.call_at(deadline, _expire, fut) if deadline is not None else None
            try:
                await fut
            except BaseException:
                if fut in self._slot_waiters:
                    self._slot_waiters.remove(fut)
                elif fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._wake_next()  # the slot this waiter was given goes to the next
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        self._in_use += 1
        idle = self._idle.get(origin)
        now = loop.time()
        while idle:
            conn = idle.pop()  # the most recently used: least likely closed by the engine
            if conn.closed or now - conn.idle_since > self._keepalive_s:
                conn.close()
                continue
            return conn, True
        try:
            return await self._connect(loop, origin, connect_deadline), False
        except BaseException:
            self._give_slot()
            raise

    async def _connect(self, loop: asyncio.AbstractEventLoop, origin: Origin,
                       deadline: float | None) -> _Connection:
        def lost(conn: _Connection) -> None:
            idle = self._idle.get(origin)
            if idle and conn in idle:
                idle.remove(conn)

        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout_at(deadline):
                _, proto = await loop.create_connection(
                    lambda: _Connection(loop, lost, self._discarded), origin.host,
                    origin.port, ssl=tls,
                    server_hostname=origin.host if tls else None)
        except TimeoutError:  # an OSError too, but a deadline, not a refusal
            raise
        except OSError as exc:  # refused, DNS (gaierror), unreachable, TLS (SSLError)
            raise ConnectFailed(str(exc) or repr(exc)) from None
        return proto

    def release(self, origin: Origin, conn: _Connection, reusable: bool) -> None:
        """Hand a connection back: idle in the pool when `reusable`, else closed."""
        conn.busy = False
        if reusable and not self._closed:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()
        self._give_slot()

    def _give_slot(self) -> None:
        self._in_use -= 1
        self._wake_next()

    def _wake_next(self) -> None:
        while self._slot_waiters:
            fut = self._slot_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    async def close(self) -> None:
        """Close every idle connection; ones in use close when released."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks
