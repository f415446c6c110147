"""Slow and hostile clients are bounded: unfinished headers, trickled bodies and streams
nobody reads are cut at their deadlines, never hold admission slots past them, and a
client's malformed headers never count against an engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx

from tests.router.conftest import MODEL, RunningRouter, until
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
COMPLETIONS = "/v1/completions"


def _hostport(router: RunningRouter) -> tuple[str, int]:
    host, port = router.url.removeprefix("http://").split(":")
    return host, int(port)


async def _closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        async with asyncio.timeout(within_s):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    return True


async def test_connections_that_never_finish_headers_are_closed(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    router = await start_router([await make_engine()], [await make_engine()],
                                header_timeout_s=0.3)
    conns = [await asyncio.open_connection(*_hostport(router)) for _ in range(20)]
    for i, (_, writer) in enumerate(conns):
        if i % 2:  # half trickle a partial request line and headers, half send nothing
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: ")
            await writer.drain()
    t0 = time.monotonic()
    assert all(await asyncio.gather(*(_closed_by_server(r, 5.0) for r, _ in conns)))
    assert time.monotonic() - t0 < 3.0
    assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200
    for _, writer in conns:
        writer.close()


async def _trickle(router: RunningRouter, pause_s: float, pieces: int) -> bytes:
    reader, writer = await asyncio.open_connection(*_hostport(router))
    body = b'{"model": "%s", "prompt": "Hello", "max_tokens": 3}' % MODEL.encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body))
    try:
        for i in range(pieces):
            writer.write(body[i:i + 1])
            await writer.drain()
            await asyncio.sleep(pause_s)
        return await asyncio.wait_for(reader.read(65536), 10)
    except ConnectionError:
        return b""
    finally:
        writer.close()


async def test_trickled_bodies_get_408_and_hold_no_admission_slot(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    router = await start_router([await make_engine()], [await make_engine()],
                                max_concurrent_requests=1, max_queued_requests=0,
                                body_chunk_timeout_s=0.3, body_timeout_s=1.0)
    slow = [asyncio.ensure_future(_trickle(router, 0.5, 3)) for _ in range(5)]  # chunk gaps
    steady = [asyncio.ensure_future(_trickle(router, 0.1, 30)) for _ in range(5)]  # total
    await asyncio.sleep(0.2)
    # Uploads still in progress hold no slot: the one slot serves everyone else.
    for _ in range(5):
        assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200
    for answer in await asyncio.gather(*slow, *steady):
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"code":"request_timeout"' in answer
    assert router.metric("pdgate_admission_active") == 0


async def test_a_stream_nobody_reads_is_cut_and_releases_everything(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    d = await make_engine(tokens=tuple("x" * 2000 for _ in range(20_000)))
    router = await start_router([await make_engine()], [d], stream_write_timeout_s=0.5)
    reader, writer = await asyncio.open_connection(*_hostport(router))
    body = (b'{"model": "%s", "prompt": "Hello", "max_tokens": 16, "stream": true}'
            % MODEL.encode())
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()  # ... and never read the answer
    labels = {"engine": d.url, "role": "decode"}
    await until(lambda: router.metric("pdgate_engine_in_flight", labels) == 1)
    await until(lambda: d.aborted_streams == 1, timeout=20)
    await until(lambda: router.metric("pdgate_admission_active") == 0)
    await until(lambda: router.metric("pdgate_engine_in_flight", labels) == 0)
    assert await _closed_by_server(reader, 10.0)
    writer.close()
    d.tokens = ("Hello", " world")
    assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200


async def test_oversized_client_headers_never_count_against_engines(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], eject_consecutive_errors=2)
    hostile = [{"X-Request-Id": "r" * 9000}, {"traceparent": "0" * 9000},
               {"tracestate": "k=" + "v" * 9000}, {"traceparent": "not-a-trace"}]
    for headers in hostile * 3:
        resp = await router.client.post(COMPLETIONS, json=BODY, headers=headers)
        assert resp.status_code == 200, resp.text
    sent = [r.headers for r in p.requests + d.requests]
    assert all(len(h.get("X-Request-Id", "")) <= 64 and "traceparent" not in h
               and "tracestate" not in h for h in sent)
    ok = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    resp = await router.client.post(COMPLETIONS, json=BODY, headers=ok)
    assert resp.status_code == 200 and d.requests[-1].headers["traceparent"] == ok["traceparent"]
    admin = await router.client.get("/ready")
    assert admin.json() == {"status": "ready", "prefill_healthy": 1, "decode_healthy": 1}
    async with httpx.AsyncClient(base_url=router.url) as bystander:
        assert (await bystander.post(COMPLETIONS, json=BODY)).status_code == 200


async def _whole_chunked(router: RunningRouter, body: bytes, pieces: int) -> bytes:
    """A chunked request sent in one write: the server has the whole body at once."""
    step = -(-len(body) // pieces)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step])
                      for i in range(0, len(body), step))
    reader, writer = await asyncio.open_connection(*_hostport(router))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()


async def test_a_body_that_arrived_whole_is_joined_and_bounded_without_deadlines(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    # The whole-body path (no deadline armed) still joins every piece and enforces the limit.
    body = b'{"model": "%s", "prompt": "%s", "max_tokens": 3}' % (MODEL.encode(), b"hi " * 40)
    router = await start_router([await make_engine()], [await make_engine()],
                                max_body_bytes=len(body))
    assert (await _whole_chunked(router, body, 4)).startswith(b"HTTP/1.1 200")
    bigger = body.replace(b'"hi ', b'"hi hi ')
    assert (await _whole_chunked(router, bigger, 4)).startswith(b"HTTP/1.1 413")


async def _body_never_starts(router: RunningRouter, expect_continue: bool) -> tuple[bytes, float]:
    """Headers announcing a body, then silence: what the router answers, and when."""
    reader, writer = await asyncio.open_connection(*_hostport(router))
    expect = b"Expect: 100-continue\r\n" if expect_continue else b""
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 60\r\n%s\r\n" % expect)
    await writer.drain()
    t0 = time.monotonic()
    try:
        answer = b""
        async with asyncio.timeout(10):
            while b"request_timeout" not in answer and (chunk := await reader.read(65536)):
                answer += chunk
        return answer, time.monotonic() - t0
    except TimeoutError:
        return answer, time.monotonic() - t0
    finally:
        writer.close()


async def test_a_body_that_never_starts_gets_408_at_the_chunk_deadline(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    router = await start_router([await make_engine()], [await make_engine()],
                                max_concurrent_requests=1, max_queued_requests=0,
                                body_chunk_timeout_s=0.5, body_timeout_s=30.0)
    plain, continued = await asyncio.gather(_body_never_starts(router, False),
                                            _body_never_starts(router, True))
    for (answer, took), first in ((plain, b"HTTP/1.1 408"),
                                  (continued, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 408")):
        assert answer.startswith(first), answer[:200]
        assert b'"code":"request_timeout"' in answer
        assert took < 3.0  # the chunk deadline (0.5 s), not the total one (30 s)
    assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200
    assert router.metric("pdgate_admission_active") == 0
