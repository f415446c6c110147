"""Deadlines on the client side of the router: request headers, request body, slow readers.

uvicorn bounds idle keep-alive connections but not a client that trickles its request: a
connection that never finishes its headers stays open forever, and a body sent a byte at a
time holds its admission slot for as long as the client likes. Four bounds close that:

- `header_deadline_protocol`: uvicorn's httptools protocol with a timer from the first byte
  of a request (or from the connection's start) to the end of its headers; when it fires,
  the connection is closed (the client sent no complete request, so nobody reads a 408).
- The same protocol caps the connections that have not completed a request (new ones, and
  ones inside a request's headers or body; not idle keep-alive ones, nor ones waiting for
  their answer) at `max_pending_connections` per process: a connection beyond it gets a
  503 and is closed before anything is read (`PendingConnections`).
- `read_body_within`: the request body with a total deadline and a per-chunk deadline
  (`RequestTimeout`, 408) and the size limit (`PayloadTooLarge`, 413).
- `ChunkWriter` (behind the router's protocol) and `WriteDeadlineSend` (an ASGI `send`
  wrapper, elsewhere): a stream's chunk that cannot be handed to a client that stopped
  reading within the deadline ends the stream (`SlowReader`), which releases the engine
  leg and the admission slot.

Configured by `RouterConfig.header_timeout_s`, `max_pending_connections`, `body_timeout_s`,
`body_chunk_timeout_s`, `stream_write_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import Message, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from pdgate.router.errors import PayloadTooLarge, RequestTimeout, TooManyConnections, error_json

__all__ = ["BODY_COMPLETE", "CONNECTION_LOST", "ChunkWriter", "PendingConnections", "SlowReader",
           "WriteDeadlineSend", "header_deadline_protocol", "header_value", "read_body_within"]

log = logging.getLogger(__name__)


CONNECTION_LOST = "pdgate.connection_lost"
"""Key in a request scope's `extensions`; its `future` is resolved when the client's
connection closes. Watching it costs a callback; watching `receive()` for `http.disconnect`
costs a task per request (router/http/api.py uses this when the server provides it)."""

BODY_COMPLETE = "pdgate.body_complete"
"""Key in a request scope's `extensions`; its `complete` is True once the server has the
whole request body (`read_body_within` then reads it without arming its deadlines)."""

RESPONSE_CYCLE = "pdgate.response_cycle"
"""Key in a request scope's `extensions`; its `cycle` is uvicorn's `RequestResponseCycle` of
the request, which `ChunkWriter` writes a streamed body through."""


class PendingConnections:
    """The connections of one server that have not completed a request, up to `limit`.

    A connection counts from its start until its first request is whole (headers and
    body), and again from each later request's first byte until that one is whole: what a
    client holds without having asked for anything yet. A connection over the limit is
    refused before anything is read, so idle or trickling clients cannot pile up sockets
    and handler tasks; clients on established keep-alive connections are still served."""

    __slots__ = ("limit", "count", "refused", "_unlogged", "_logged_at")

    _LOG_EVERY_S = 10.0

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.refused = 0  # connections refused so far
        self._unlogged = 0
        self._logged_at = float("-inf")

    def note_refused(self) -> None:
        """Count a refused connection; warn at most every `_LOG_EVERY_S` seconds."""
        self.refused += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= self._LOG_EVERY_S:
            log.warning("refused %d new connection(s): %d connections have not completed a "
                        "request (--max-pending-connections %d)", self._unlogged, self.count,
                        self.limit)
            self._unlogged = 0
            self._logged_at = now


def _refusal() -> bytes:
    body = error_json(TooManyConnections(
        "too many connections have not completed a request; retry later"))
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%b"
            % (len(body), body))


_REFUSAL = _refusal()


class _HeaderDeadlineProtocol(HttpToolsProtocol):
    """Closes a connection whose request headers are not complete `header_timeout_s` after
    the connection opened or the request's first byte arrived; refuses a new connection
    while `pending` is full."""

    header_timeout_s = 10.0
    pending: PendingConnections
    _header_timer: asyncio.TimerHandle | None = None
    _body_state: dict[object, object]
    _cycle_slot: dict[object, object]
    _in_headers = False  # a request began and its headers are not complete yet
    _counted = False  # counted in `pending`: no complete request since it began

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CorkedTransport(transport, self.loop))  # type: ignore[arg-type]
        self._lost: asyncio.Future[None] = self.loop.create_future()
        pending = self.pending
        if pending.count >= pending.limit:
            pending.note_refused()
            self.transport.write(_REFUSAL)
            self.transport.close()  # nothing is read: the answer goes out, then the close
            return
        pending.count += 1
        self._counted = True
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        if not self._counted:
            self.pending.count += 1
            self._counted = True
        super().on_message_begin()
        # ASGI extensions map a name to a dict of details.
        self._body_state = {"complete": False}
        lost: dict[object, object] = {"future": self._lost}
        self._cycle_slot = {}  # filled once the cycle exists (`on_headers_complete`)
        self.scope["extensions"] = {CONNECTION_LOST: lost, BODY_COMPLETE: self._body_state,
                                    RESPONSE_CYCLE: self._cycle_slot}
        # The timer is armed by `data_received` only if this read ends inside the headers:
        # most requests arrive whole, and a timer armed and cancelled in one read is waste.
        self._in_headers = True

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_headers:
            self._arm_header_timer()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._body_state["complete"] = True
        self._uncount()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()
        # Not for an upgrade: uvicorn made no cycle for this request then.
        if self.cycle is not None and self.cycle.scope is self.scope:
            self._cycle_slot["cycle"] = self.cycle

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._uncount()
        if not self._lost.done():
            self._lost.set_result(None)
        super().connection_lost(exc)

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.pending.count -= 1

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class _CorkedTransport:
    """Sends the writes of one event-loop iteration as one: uvicorn writes a response's
    status line and headers, then its body, each with its own `send` syscall (two per
    answer, three for a short stream). Writes over `_CORK_MAX` bytes go out at once, after
    whatever is held, so a large body is never copied. `close()` sends what is held first."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if len(data) > _CORK_MAX:
            self._flush()
            self._transport.write(data)
            return
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(data)

    def _flush(self) -> None:
        held = self._held
        if not held:
            return
        self._held = []
        if not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._flush()
        self._transport.set_protocol(protocol)

    def __getattr__(self, name: str) -> object:  # anything else uvicorn may ask
        return getattr(self._transport, name)


_CORK_MAX = 64 * 1024


def header_deadline_protocol(
    header_timeout_s: float, max_pending_connections: int = 1024
) -> type[HttpToolsProtocol]:
    """The protocol class to pass as uvicorn's `http=` for this header deadline and cap
    on pending connections (one count per call: pass the class to one server). Its
    transport also sends each loop iteration's writes as one: `_CorkedTransport`."""
    return type("HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,),
                {"header_timeout_s": header_timeout_s,
                 "pending": PendingConnections(max_pending_connections)})


async def read_body_within(
    request: Request, limit: int, total_s: float, chunk_s: float
) -> bytes:
    """The request body: at most `limit` bytes (413 beyond, without reading it all), within
    `total_s` seconds in all and `chunk_s` seconds between two chunks (408 otherwise).
    A client that disconnects meanwhile raises Starlette's `ClientDisconnect`.

    Reads the ASGI messages itself under one rescheduled deadline: Starlette's
    `request.stream()` costs a generator, a final empty chunk and a timer per chunk."""
    length = header_value(request.scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    receive = request.receive
    body = _Body(limit)
    if (request.scope.get("extensions") or {}).get(BODY_COMPLETE, {}).get("complete"):
        # The server holds the whole body (a small body comes with the headers): reading
        # it waits for nothing, so no deadline is armed.
        while body.take(await receive()):
            pass
        return body.joined()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_s
    try:
        # `timeout_at` (a loop time), not `timeout` (a delay): the first chunk's deadline
        # must hold for a body that never starts, with or without `Expect: 100-continue`.
        async with asyncio.timeout_at(min(loop.time() + chunk_s, deadline)) as timer:
            while body.take(await receive()):
                timer.reschedule(min(loop.time() + chunk_s, deadline))
    except TimeoutError:
        raise RequestTimeout(
            f"request body not received in time (at most {total_s:g}s in all and "
            f"{chunk_s:g}s between chunks)") from None
    return body.joined()


class _Body:
    """A request body's pieces as ASGI messages bring them, within `limit` bytes."""

    __slots__ = ("_parts", "_size", "_limit")

    def __init__(self, limit: int) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self._limit = limit

    def take(self, message: Message) -> bool:
        """Add one ASGI request message's body; True while more body follows."""
        if message["type"] != "http.request":
            raise ClientDisconnect()
        part = message.get("body", b"")
        if part:
            self._size += len(part)
            if self._size > self._limit:
                raise PayloadTooLarge(f"request body exceeds {self._limit} bytes")
            self._parts.append(part)
        return bool(message.get("more_body", False))

    def joined(self) -> bytes:
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)


def header_value(scope: Scope, name: bytes) -> str | None:
    """The value of request header `name` (lower case), or None: a scan of the raw ASGI
    headers (Starlette's `Headers.get` raises and catches a KeyError for a missing one)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


class SlowReader(Exception):
    """A streamed chunk could not be written before the write deadline: the client is not
    reading. The stream ends; the connection is closed by the server."""


class ChunkWriter:
    """Writes a streamed response body straight to the client's transport, in the chunked
    framing uvicorn chose for it: one `write` per chunk instead of an ASGI message through
    every middleware's `send` wrapper and uvicorn's `send` (~3 µs per message).

    For a response whose `http.response.start` went through ASGI `send` (the access log
    and tracing see the status there) and whose last, empty body message goes through
    `send` too, after `drain()` (uvicorn then ends the body, closes or keeps the connection
    and starts the next pipelined request). A chunk waits while the client does not read
    (the transport is over its high-water mark); after `timeout_s` without it reading the
    stream is cut (`SlowReader`). The timer exists only while waiting."""

    __slots__ = ("_cycle", "_timeout_s")

    def __init__(self, cycle: RequestResponseCycle, timeout_s: float) -> None:
        self._cycle = cycle
        self._timeout_s = timeout_s

    @classmethod
    def of(cls, scope: Scope, timeout_s: float) -> ChunkWriter | None:
        """The writer of this request's response once its start was sent; None when the
        server is not the router's protocol or the body is not chunked (nothing else can
        be written around uvicorn then)."""
        slot: dict[str, Any] = (scope.get("extensions") or {}).get(RESPONSE_CYCLE, {})
        cycle = slot.get("cycle")
        if cycle is None or not cycle.response_started or cycle.response_complete \
                or cycle.chunked_encoding is not True:
            return None
        return cls(cycle, timeout_s)

    async def write(self, chunk: bytes) -> None:
        """Send `chunk` (not empty: an empty chunk ends a chunked body), waiting while the
        client does not read. Nothing is written once the client is gone."""
        cycle = self._cycle
        if cycle.flow.write_paused:
            await self.drain()
        if not cycle.disconnected:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))

    async def drain(self) -> None:
        """Wait until the client reads what it was sent (`SlowReader` after the deadline)."""
        cycle = self._cycle
        if not cycle.flow.write_paused or cycle.disconnected:
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                await cycle.flow.drain()
        except TimeoutError:
            raise SlowReader(f"client did not read for {self._timeout_s:g}s") from None


class WriteDeadlineSend:
    """Wraps an ASGI `send` so each body message must be accepted within `timeout_s`
    (uvicorn's send waits while the transport's buffer is above its high-water mark, i.e.
    while the client does not read); a late one raises `SlowReader`. `close()` when the
    response is over (the last body message does it too).

    One watchdog timer per stream, not one per chunk (an `asyncio.timeout` around every
    send was ~5% of a streamed request): each send notes when it began; the watchdog looks
    every quarter of the timeout and cancels the sending task once a send has been pending
    for the whole timeout, so a stalled send ends between 1 and 1.25 timeouts."""

    __slots__ = ("_send", "_timeout_s", "_since", "_timer", "_task", "_fired")

    def __init__(self, send: Send, timeout_s: float) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._since: float | None = None  # loop time the pending body send began
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[object] | None = None
        self._fired = False

    async def __call__(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        loop = asyncio.get_running_loop()
        if self._timer is None and self._task is None:
            self._task = asyncio.current_task()
            self._timer = loop.call_later(self._timeout_s / 4, self._check)
        self._since = loop.time()
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if not self._fired or self._task is None:
                raise
            self._fired = False
            self._task.uncancel()
            raise SlowReader(f"client did not read for {self._timeout_s:g}s") from None
        finally:
            self._since = None
        if not message.get("more_body", False):
            self.close()

    def _check(self) -> None:
        self._timer = None
        if self._task is None:
            return
        loop = self._task.get_loop()
        since = self._since
        if since is not None and loop.time() - since >= self._timeout_s:
            self._fired = True
            self._task.cancel()
            return
        self._timer = loop.call_later(self._timeout_s / 4, self._check)

    def close(self) -> None:
        """Stop the watchdog (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
