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
connection, as browsers and aiohttp do; when that new connection is refused, the failure is
`Dropped`, not `ConnectFailed` (the engine may have taken the request before it died). A
drop later than that is an engine that took the request and died (or was killed) working on
it: the request is not sent again behind the caller's back (engine POSTs are not idempotent:
a prefill would pin its blocks twice); the flow's own retry and failover decide what happens
next.

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
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdgate.router.engines.http11_connection import (
    DISCARD_REASONS,
    BadResponse,
    ConnectFailed,
    Connection,
    DiscardListener,
    Dropped,
    HTTPClientError,
    InvalidHeader,
    expire,
)

__all__ = ["DISCARD_REASONS", "END_GRACE_S", "STALE_CLOSE_S", "BadResponse", "ConnectFailed",
           "ConnectionPool", "DiscardListener", "Dropped", "HTTPClientError", "InvalidHeader",
           "Response"]

# A keep-alive connection the server had already closed drops the request at once (its FIN
# crossed ours); later than this, the engine had the request.
STALE_CLOSE_S = 0.25
# After an SSE `[DONE]`, the body's end (the last chunk) follows at once from an engine that
# keeps to the protocol; one that has not ended it by then loses the connection.
END_GRACE_S = 1.0

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


class Response:
    """A response whose status line and headers arrived; read its body with `read_some`.
    `release()` once done: the connection goes back to the pool when the body was read to
    its end (and the server keeps it alive), else it is closed. `close()` always closes."""

    __slots__ = ("_conn", "_pool", "_origin", "status", "headers")

    def __init__(self, pool: ConnectionPool, origin: Origin, conn: Connection) -> None:
        self._pool, self._origin = pool, origin
        self._conn: Connection | None = conn
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
        self._idle: dict[Origin, list[Connection]] = {}
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
        for attempt in range(2):
            try:
                conn, reused = await self._acquire(origin, connect_deadline, deadline)
            except ConnectFailed as exc:
                if not attempt:
                    raise
                # The first connection may have delivered the request before it closed (an
                # engine killed just after taking it): the caller must not read "refused"
                # as "never sent" (a decode leg would hand P's KV params to a second D).
                raise Dropped("connection closed before the response, and a new one was "
                              f"refused ({exc}): the engine may have taken the request"
                              ) from None
            sent = loop.time()
            try:
                conn.send(head, body)
                await conn.read_headers(deadline)
            except Dropped:
                self.release(origin, conn, False)
                if not attempt and reused and not conn.got_bytes and \
                        loop.time() - sent < STALE_CLOSE_S:
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
                       deadline: float | None) -> tuple[Connection, bool]:
        if self._closed:
            raise Dropped("the engine client is closed")
        loop = asyncio.get_running_loop()
        while self._in_use >= self._limit:
            fut: asyncio.Future[None] = loop.create_future()
            self._slot_waiters.append(fut)
            timer = loop.call_at(deadline, expire, fut) if deadline is not None else None
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
                       deadline: float | None) -> Connection:
        def lost(conn: Connection) -> None:
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
                    lambda: Connection(loop, lost, self._discarded), origin.host,
                    origin.port, ssl=tls,
                    server_hostname=origin.host if tls else None)
        except TimeoutError:  # an OSError too, but a deadline, not a refusal
            raise
        except OSError as exc:  # refused, DNS (gaierror), unreachable, TLS (SSLError)
            raise ConnectFailed(str(exc) or repr(exc)) from None
        return proto

    def release(self, origin: Origin, conn: Connection, reusable: bool) -> None:
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
