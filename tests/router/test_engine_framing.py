"""Exact framing on pooled engine connections: a raw-socket decode engine that writes exact
bytes (a late second response, the head of another response after its answer, a partial
one, body bytes past Content-Length, SSE after `[DONE]`, ambiguous framing headers) behind
a real router, under concurrent clients. Every client gets its own answer or a clear 502,
a stream ends at its `[DONE]`, the faulty connections are closed and counted, and the
requests after the fault are unaffected (no 504 after a deadline, no other client's body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from pdgate.router.engines.http11 import DISCARD_REASONS, END_GRACE_S, ConnectionPool
from tests.router.conftest import MODEL, RunningRouter, sse_events, until
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]

CLIENTS = 8  # concurrent clients
ROUNDS = 5  # requests each, one after another
PHASE_S = 20.0  # a phase's bound: far below the router's deadlines set below
# Deadlines far past a phase's bound; the breaker never ejects the one decode engine (the
# 502s of a faulty phase would otherwise make the next phase's answers 503s).
SETTINGS = {"decode_first_byte_timeout_s": 60.0, "decode_idle_timeout_s": 60.0,
            "max_retries": 0, "eject_consecutive_errors": 100_000}
DISCARDED = "pdgate_engine_connections_discarded_total"


def discarded(router: RunningRouter) -> float:
    return sum(router.metric(DISCARDED, {"reason": r}) for r in DISCARD_REASONS)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def json_answer(rid: str, tag: str, framing: bytes | None = None) -> bytes:
    """A completion answer naming `rid` whose text is the client's `tag`; `framing`
    replaces the Content-Length header line."""
    body = json.dumps({
        "id": f"cmpl-{rid}", "object": "text_completion", "model": MODEL,
        "choices": [{"index": 0, "text": tag, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }).encode()
    length = b"Content-Length: %d\r\n" % len(body) if framing is None else framing
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + length
            + b"X-Request-Id: " + rid.encode() + b"\r\n\r\n")
    return head + body


def stream_events(rid: str, tag: str) -> bytes:
    event = json.dumps({"id": f"cmpl-{rid}", "object": "text_completion", "model": MODEL,
                        "choices": [{"index": 0, "text": tag, "finish_reason": None}]})
    return b"data: " + event.encode() + b"\n\ndata: [DONE]\n\n"


def stream_head(rid: str, framing: bytes = b"Transfer-Encoding: chunked\r\n") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + framing
            + b"X-Request-Id: " + rid.encode() + b"\r\n\r\n")


def stream_answer(rid: str, tag: str) -> bytes:
    return stream_head(rid) + _chunk(stream_events(rid, tag)) + b"0\r\n\r\n"


EXTRA_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Request-Id: other\r\n"


def faulty_bytes(fault: str, rid: str, tag: str, stream: bool) -> bytes:
    """What the engine writes at once for one request under `fault`."""
    answer = stream_answer(rid, tag) if stream else json_answer(rid, tag)
    if fault == "extra_head":  # the head of a second response, in the same write
        return answer + EXTRA_HEAD
    if fault == "extra_head_length":  # ... whose length would swallow the next answer
        return answer + EXTRA_HEAD + b"Content-Length: 100000\r\n\r\n"
    if fault == "partial_extra":  # a second response cut off in its status line
        return answer + b"HTTP/1.1 20"
    if fault == "body_past_length":  # more body than Content-Length says
        return answer + b'{"id": "cmpl-other", "choices": []}'
    if fault == "after_done":  # the stream goes on after [DONE] (and never ends)
        extra = json.dumps({"id": f"cmpl-{rid}", "choices": [{"index": 0, "text": "late"}]})
        return (stream_head(rid) + _chunk(stream_events(rid, tag))
                + _chunk(b"data: " + extra.encode() + b"\n\n"))
    if fault == "done_no_end":  # [DONE], then the body never ends
        return stream_head(rid) + _chunk(stream_events(rid, tag))
    if fault == "duplicate_length":
        if stream:
            return stream_head(rid, b"Content-Length: 1\r\nContent-Length: 2\r\n") + b"ab"
        return json_answer(rid, tag, b"Content-Length: 10\r\nContent-Length: 12\r\n")
    if fault == "chunked_and_length":
        both = b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n"
        if stream:
            return stream_head(rid, both) + _chunk(stream_events(rid, tag)) + b"0\r\n\r\n"
        body = json_answer(rid, tag).split(b"\r\n\r\n", 1)[1]
        return json_answer(rid, tag, both).split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n" + (
            _chunk(body) + b"0\r\n\r\n")
    assert fault in ("none", "late_extra"), fault
    return answer


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return lines[0], headers, body


class RawEngine:
    """A decode engine on a raw socket: each completion is answered with the exact bytes
    `faulty_bytes` gives for the current `fault`; `late_extra` writes the whole answer
    again 50 ms later on the same connection (meanwhile the router may have sent the
    next request on it). The answer's text is the request's `user` field (the client's
    tag), its id the router's `X-Request-Id`."""

    def __init__(self) -> None:
        self.fault = "none"
        self.url = ""
        self.answered = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError,
                                 asyncio.LimitOverrunError):
            while True:
                line, headers, body = await read_request(reader)
                if line.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    continue
                req = json.loads(body)
                rid = headers.get(b"x-request-id", b"none").decode()
                stream = bool(req.get("stream"))
                data = faulty_bytes(self.fault, rid, str(req.get("user", "")), stream)
                writer.write(data)
                self.answered += 1
                if self.fault == "late_extra":
                    loop.call_later(0.05, _write_if_open, writer, data)
        self._writers.discard(writer)
        writer.close()


def _write_if_open(writer: asyncio.StreamWriter, data: bytes) -> None:
    if not writer.is_closing():
        writer.write(data)


async def _ask(client: httpx.AsyncClient, tag: str, stream: bool) -> tuple[int, str, float]:
    """One client request: (status, the answer's text or the error code, seconds)."""
    t0 = time.monotonic()
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "user": tag,
            "stream": stream}
    resp = await client.post("/v1/completions", json=body)
    took = time.monotonic() - t0
    if resp.status_code != 200:
        return resp.status_code, resp.json()["error"]["code"], took
    if not stream:
        return 200, resp.json()["choices"][0]["text"], took
    events = sse_events(resp.text)
    if events[-1] != "[DONE]":
        return 200, f"no [DONE]: {resp.text[-200:]!r}", took
    errors = [e for e in events[:-1] if "error" in e]
    if errors:  # the stream failed after its start: a 502 inside the stream
        return 502, errors[0]["error"]["code"], took
    return 200, "".join(e["choices"][0]["text"] for e in events[:-1]), took


async def _phase(router: RunningRouter, stream: bool) -> list[tuple[str, int, str, float]]:
    """CLIENTS concurrent clients, ROUNDS requests each: (tag, status, text, seconds)."""
    async def client(i: int) -> list[tuple[str, int, str, float]]:
        out = []
        for j in range(ROUNDS):
            tag = f"client-{i}-{j}"
            out.append((tag, *await _ask(router.client, tag, stream)))
        return out

    runs = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(CLIENTS))),
                                  PHASE_S)
    return [r for run in runs for r in run]


CASES = [
    ("late_extra", False), ("late_extra", True),
    ("extra_head", False), ("extra_head", True),
    ("extra_head_length", False), ("extra_head_length", True),
    ("partial_extra", False), ("partial_extra", True),
    ("body_past_length", False),
    ("after_done", True), ("done_no_end", True),
    ("duplicate_length", False), ("duplicate_length", True),
    ("chunked_and_length", False), ("chunked_and_length", True),
]
# Faults whose answer is still whole and correctly framed: the client gets it (200).
ANSWER_STANDS = {"extra_head", "extra_head_length", "partial_extra", "body_past_length",
                 "after_done", "done_no_end"}
# Faults with no valid framing: a clear 502 for every request.
REFUSED = {"duplicate_length", "chunked_and_length"}


@pytest.mark.parametrize(("fault", "stream"), CASES,
                         ids=[f"{f}-{'sse' if s else 'json'}" for f, s in CASES])
async def test_each_client_gets_its_own_answer_or_a_502(
    make_engine: MakeEngine, start_router: StartRouter, fault: str, stream: bool,
) -> None:
    engine = RawEngine()
    await engine.start()
    try:
        p = await make_engine(engine_id="P0")
        router = await start_router([p], [engine], **SETTINGS)
        engine.fault = fault
        for tag, status, text, took in await _phase(router, stream):
            # Never another client's body, never a deadline's 504.
            assert (status, text) == (200, tag) or status == 502, (tag, status, text, took)
            if fault in ANSWER_STANDS:
                assert (status, text) == (200, tag), (tag, status, text)
            if fault in REFUSED:
                assert status == 502, (tag, status, text)
            if stream:  # ended at its [DONE] (or refused), not at the idle deadline
                assert took < 10.0, (tag, took)
        if fault != "late_extra":  # timing decides whether a late answer meets one
            # Each faulty connection closed and counted (a body that never ends after its
            # [DONE] within END_GRACE_S).
            least = 1 if fault in REFUSED else CLIENTS
            await until(lambda: discarded(router) >= least, timeout=END_GRACE_S + 5)
        # The engine behaves again: every next request gets its own answer, at once.
        engine.fault = "none"
        await asyncio.sleep(0.2)  # late answers still in flight land on idle connections
        for tag, status, text, took in await _phase(router, stream):
            assert (status, text) == (200, tag), (tag, status, text, took)
    finally:
        await engine.stop()


# -- the pool itself: what reaches the next request on a reused connection ------------

async def _get(pool: ConnectionPool, url: str, rid: str) -> tuple[int, bytes]:
    deadline = asyncio.get_running_loop().time() + 3.0
    resp = await pool.request("POST", url, "/v1/completions",
                              json.dumps({"user": rid}).encode(), {"X-Request-Id": rid},
                              connect_deadline=deadline, deadline=deadline)
    body = b""
    while piece := await resp.read_some(deadline):
        body += piece
    resp.release()
    return resp.status, body


@pytest.mark.parametrize("fault", ["extra_head", "partial_extra", "body_past_length"])
async def test_a_connection_with_bytes_past_its_answer_is_never_reused(fault: str) -> None:
    engine = RawEngine()
    await engine.start()
    discarded: list[str] = []
    pool = ConnectionPool(limit=1, keepalive_s=30.0)
    pool.set_discard_listener(discarded.append)
    try:
        for i in range(4):  # one at a time: each would reuse the previous connection
            engine.fault = fault if i % 2 == 0 else "none"
            status, body = await _get(pool, engine.url, f"r{i}")
            assert status == 200 and json.loads(body)["choices"][0]["text"] == f"r{i}"
        assert discarded == ["extra_message"] * 2 if fault != "body_past_length" else \
            len(discarded) == 2
    finally:
        await pool.close()
        await engine.stop()


async def test_a_late_answer_on_an_idle_connection_closes_it() -> None:
    engine = RawEngine()
    await engine.start()
    discarded: list[str] = []
    pool = ConnectionPool(limit=1, keepalive_s=30.0)
    pool.set_discard_listener(discarded.append)
    try:
        engine.fault = "late_extra"
        assert (await _get(pool, engine.url, "r0"))[0] == 200
        await asyncio.sleep(0.2)  # the late copy arrives while the connection is idle
        engine.fault = "none"
        status, body = await _get(pool, engine.url, "r1")
        assert json.loads(body)["choices"][0]["text"] == "r1"
        assert discarded == ["idle_bytes"]
    finally:
        await pool.close()
        await engine.stop()
