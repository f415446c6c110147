"""The engine HTTP client (router/engines/http11.py) against raw asyncio servers: keep-alive
reuse, the retry on a kept-alive connection the server closed, body framings, the pool's
connection limit, its failure types, and a body finished early (an SSE stream at [DONE]).
Bytes past a response's framing: tests/router/test_engine_framing.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from pdgate.router.engines.http11 import (
    END_GRACE_S,
    STALE_CLOSE_S,
    BadResponse,
    ConnectFailed,
    ConnectionPool,
    Dropped,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server; yields its URL and a list counting accepted connections."""
    accepted: list[int] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        # The client hanging up (or the test ending) is how every handler stops.
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError,
                                 asyncio.CancelledError):
            await handler(reader, writer)
        writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        srv.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


async def answer_then_take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                           ) -> tuple[bytes, bytes]:
    """A handler's opening: answer the connection's first request, then read (and leave
    unanswered) the next one; both requests' heads."""
    first = await read_request(reader)
    writer.write(OK)
    await writer.drain()
    return first, await read_request(reader)


async def get(pool: ConnectionPool, url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    deadline = asyncio.get_running_loop().time() + timeout
    resp = await pool.request("POST", url, "/x", b"{}", {}, connect_deadline=deadline,
                              deadline=deadline)
    body = b""
    while piece := await resp.read_some(deadline):
        body += piece
    resp.release()
    return resp.status, body


def new_pool(limit: int = 8) -> ConnectionPool:
    return ConnectionPool(limit=limit, keepalive_s=30.0)


async def test_keep_alive_reuses_one_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)

    async with server(handler) as (url, accepted):
        pool = new_pool()
        for _ in range(3):
            assert await get(pool, url) == (200, b"ok")
        assert len(accepted) == 1
        await pool.close()


async def test_a_kept_alive_connection_the_server_closed_is_retried_once() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_then_take(reader, writer)  # the second is dropped unanswered

    async with server(handler) as (url, accepted):
        pool = new_pool()
        assert await get(pool, url) == (200, b"ok")
        assert await get(pool, url) == (200, b"ok")  # on a fresh connection
        assert len(accepted) == 2
        await pool.close()


async def test_a_kept_alive_connection_dropped_after_the_engine_took_the_request_is_not_retried(
) -> None:
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.extend(await answer_then_take(reader, writer))
        await asyncio.sleep(2 * STALE_CLOSE_S)  # working on it... then the engine dies

    async with server(handler) as (url, accepted):
        pool = new_pool()
        assert await get(pool, url) == (200, b"ok")
        with pytest.raises(Dropped):
            await get(pool, url)
        # Not sent again behind the caller's back: engine POSTs are not idempotent.
        assert (len(requests), len(accepted)) == (2, 1)
        await pool.close()


async def test_a_fresh_connection_closed_unanswered_is_dropped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with server(handler) as (url, _):
        pool = new_pool()
        with pytest.raises(Dropped):
            await get(pool, url)
        await pool.close()


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
    b"HTTP/1.0 200 OK\r\n\r\nabc",  # ends with the connection
])
async def test_body_framings(reply: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()

    async with server(handler) as (url, _):
        pool = new_pool()
        assert await get(pool, url) == (200, b"abc")
        await pool.close()


async def test_garbage_is_a_bad_response_and_a_stall_times_out() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    pool = new_pool()
    async with server(garbage) as (url, _):
        with pytest.raises(BadResponse):
            await get(pool, url)
    async with server(stall) as (url, _):
        with pytest.raises(TimeoutError):
            await get(pool, url, timeout=0.2)
    await pool.close()


async def test_endless_headers_are_a_bad_response() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(100_000):
            writer.write(b"X-Pad-%d: %s\r\n" % (i, b"y" * 100))
            await writer.drain()

    async with server(handler) as (url, _):
        pool = new_pool()
        with pytest.raises(BadResponse, match="headers over"):
            await get(pool, url, timeout=10)
        await pool.close()


async def test_refused_connection_is_connect_failed() -> None:
    async with server(read_request) as (url, _):  # type: ignore[arg-type]
        pass  # closed: nothing listens there any more
    pool = new_pool()
    with pytest.raises(ConnectFailed):
        await get(pool, url)
    await pool.close()


async def test_the_pool_limit_queues_requests() -> None:
    active = 0
    peak = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal active, peak
        while True:
            await read_request(reader)
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.02)
            active -= 1
            writer.write(OK)

    async with server(handler) as (url, _):
        pool = new_pool(limit=2)
        results = await asyncio.gather(*(get(pool, url) for _ in range(6)))
        assert results == [(200, b"ok")] * 6
        assert peak == 2
        await pool.close()


async def test_header_injection_is_refused() -> None:
    pool = new_pool()
    deadline = asyncio.get_running_loop().time() + 1
    with pytest.raises(ValueError, match="line break"):
        await pool.request("POST", "http://127.0.0.1:9", "/x", b"", {"X-A": "a\r\nB: c"},
                           connect_deadline=deadline, deadline=deadline)
    await pool.close()


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
DONE_CHUNK = b"e\r\ndata: [DONE]\n\n\r\n"


@pytest.mark.parametrize(("after_done", "reused"), [
    (b"0\r\n\r\n", True),  # the body ends right after [DONE]: the connection is pooled
    (b"3\r\n: x\r\n0\r\n\r\n", False),  # more body after [DONE]: closed
    (b"", False),  # the body never ends: closed after END_GRACE_S
])
async def test_a_body_finished_early_is_pooled_only_if_it_ends_there(
    after_done: bytes, reused: bool
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(SSE_HEAD + DONE_CHUNK)
            await asyncio.sleep(0.05)  # the end comes in a later read, after the caller left
            writer.write(after_done)

    async with server(handler) as (url, accepted):
        pool = new_pool()
        discarded: list[str] = []
        pool.set_discard_listener(discarded.append)
        for _ in range(2):
            deadline = asyncio.get_running_loop().time() + 2.0
            resp = await pool.request("POST", url, "/x", b"{}", {}, connect_deadline=deadline,
                                      deadline=deadline)
            assert await resp.read_some(deadline) == b"data: [DONE]\n\n"
            resp.finish()  # returns at once: the end is awaited without the caller
            await asyncio.sleep(0.1 if reused or after_done else END_GRACE_S + 0.2)
        assert len(accepted) == (1 if reused else 2)
        assert discarded == ([] if reused else ["sse_after_done"] * 2)
        await pool.close()


async def test_a_refusal_after_a_kept_alive_connection_closed_is_not_connect_failed() -> None:
    """An engine killed just after it took a request on a kept-alive connection: the retry's
    connection is refused. That is no proof the request never arrived (a decode engine may
    have read P's KV and released it), so the failure is `Dropped`, not `ConnectFailed`."""
    took = asyncio.Event()
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.extend(await answer_then_take(reader, writer))
        took.set()  # the engine took it... and dies at once, nothing listens any more

    async with server(handler) as (url, accepted):
        pool = new_pool()
        assert await get(pool, url) == (200, b"ok")
        second = asyncio.ensure_future(get(pool, url))
        await took.wait()
    with pytest.raises(Dropped, match="may have taken the request"):
        await second
    assert (len(requests), len(accepted)) == (2, 1)
    await pool.close()


async def test_two_kept_alive_connections_closed_in_a_row_are_dropped_not_a_crash() -> None:
    """The retry may meet a second stale idle connection (an engine that closed every
    connection at once): that is `Dropped`, after one retry, never an internal error."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_then_take(reader, writer)  # the second is dropped unanswered

    async with server(handler) as (url, accepted):
        pool = new_pool()
        assert await asyncio.gather(get(pool, url), get(pool, url)) == [(200, b"ok")] * 2
        assert len(accepted) == 2  # two idle connections now
        with pytest.raises(Dropped):
            await get(pool, url)
        assert len(accepted) == 2  # no third connection: one retry only
        await pool.close()
