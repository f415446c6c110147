"""Decode engines that break the protocol, send too much, or answer 4xx the client did not
cause: each is refused (a 502 before the first byte, retried on another engine; mid-stream
an SSE error event then [DONE]) and counted against the engine; the client's own 4xx still
pass through and never count."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from pdgate.router.config import RouterConfig
from pdgate.router.engines.client import EngineClient
from pdgate.router.errors import EngineProtocolError, EngineReplyTooLarge, RouterError
from tests.router.conftest import MODEL, RunningRouter, sse_events
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
Reply = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]

COMPLETIONS = "/v1/completions"
BODY: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
STREAM = {**BODY, "stream": True}
EVENT = b'data: {"id":"cmpl-h","object":"text_completion","choices":[{"index":0,"text":"x"}]}\n\n'
DONE = b"data: [DONE]\n\n"


class HostileEngine:
    """A decode engine on loopback whose completion answer is `reply` (set per test).
    `written` counts body bytes it managed to send; `cut_off` says the router hung up."""

    def __init__(self) -> None:
        self.reply: Reply = _json(b"{}")
        self.url = ""
        self.calls = 0
        self.written = 0
        self.cut_off = False
        self.headers: dict[str, str] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/health", lambda _r: _ok())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self.headers = dict(request.headers)
        return await self.reply(request, await request.json())

    async def write(self, resp: web.StreamResponse, data: bytes) -> None:
        try:
            await resp.write(data)
        except (ConnectionError, RuntimeError):
            self.cut_off = True
            raise
        self.written += len(data)


async def _ok() -> web.Response:
    return web.Response(text="ok")


def _json(raw: bytes, status: int = 200, content_type: str = "application/json") -> Reply:
    async def reply(_r: web.Request, _b: dict[str, Any]) -> web.StreamResponse:
        return web.Response(body=raw, status=status, headers={"Content-Type": content_type})
    return reply


def _error(status: int, message: str, param: str | None = None) -> Reply:
    err = {"error": {"message": message, "type": "X", "param": param, "code": status}}
    return _json(json.dumps(err).encode(), status)


def _sse(engine: HostileEngine, parts: list[bytes], gap_s: float = 0.0) -> Reply:
    async def reply(request: web.Request, _b: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError, RuntimeError):
            for i, part in enumerate(parts):
                if i and gap_s:
                    await asyncio.sleep(gap_s)
                await engine.write(resp, part)
            await resp.write_eof()
        return resp
    return reply


@pytest.fixture
async def bad() -> AsyncIterator[HostileEngine]:
    engine = HostileEngine()
    await engine.start()
    yield engine
    await engine.stop()


async def _router(make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine,
                  *, good: bool = False, **kw: Any) -> tuple[RunningRouter, FakeEngine | None]:
    p = await make_engine(engine_id="P0")
    d = await make_engine(engine_id="D-good") if good else None
    decode: list[Any] = [bad] + ([d] if d else [])
    router = await start_router([p], decode, decode_policy="round-robin", **kw)
    return router, d


def _assert_502(resp: Any, code: str, url: str) -> None:
    assert resp.status_code == 502, resp.text
    err = resp.json()["error"]
    assert err["code"] == code, err
    assert url in err["message"]


async def test_engines_are_not_invited_to_compress(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    # The router relays and checks bodies as sent (no decompression): a gzipped answer
    # would be garbage, so it must not ask for one.
    router, _ = await _router(make_engine, start_router, bad)
    bad.reply = _json(b'{"choices": []}')
    assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200
    assert "Accept-Encoding" not in bad.headers


# -- 1. protocol: non-streaming --------------------------------------------------------

GARBAGE_REPLIES = {
    "not json": b"<html>hello</html>",
    "json array": b"[1, 2, 3]",
    "json string": b'"ok"',
    "no choices": b'{"id": "cmpl-1", "object": "text_completion"}',
    "choices not a list": b'{"choices": {"0": "x"}}',
    "invalid utf-8": b'{"choices": [{"text": "\xff\xfe"}]}',
    "truncated": b'{"choices": [{"text": "abc',
    "empty": b"",
    "nested 5000 deep": b'{"choices": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
}


@pytest.mark.parametrize("raw", GARBAGE_REPLIES.values(), ids=GARBAGE_REPLIES.keys())
async def test_non_streaming_garbage_is_a_502(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine, raw: bytes
) -> None:
    router, _ = await _router(make_engine, start_router, bad)
    bad.reply = _json(raw)
    resp = await router.client.post(COMPLETIONS, json=BODY)
    _assert_502(resp, "engine_protocol_error", bad.url)


async def test_non_streaming_garbage_is_retried_and_counted(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, good = await _router(make_engine, start_router, bad, good=True,
                                 eject_consecutive_errors=2)
    bad.reply = _json(b"[]")
    for _ in range(2):  # round-robin: the bad engine first, then the good one
        resp = await router.client.post(COMPLETIONS, json=BODY)
        assert resp.status_code == 200
        assert resp.headers["x-pdgate-decode-engine"] == good.url  # type: ignore[union-attr]
    assert router.metric("pdgate_retries_total", {"role": "decode"}) >= 1
    # Counted against the engine: two in a row open its breaker.
    assert router.metric("pdgate_breaker_opened_total", {"role": "decode"}) == 1


# -- 1. protocol: streams, before the first byte ----------------------------------------

async def test_json_where_sse_was_asked_is_a_502(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, _ = await _router(make_engine, start_router, bad)
    bad.reply = _json(b'{"choices": [{"text": "x"}]}')
    resp = await router.client.post(COMPLETIONS, json=STREAM)
    _assert_502(resp, "engine_protocol_error", bad.url)
    assert "text/event-stream" in resp.json()["error"]["message"]


FIRST_EVENTS = {
    "not json": b"data: hello\n\n",
    "json array": b"data: [1]\n\n",
    "not utf-8": b'data: {"text": "\xc3\x28"}\n\n',
    "not an sse line": b'{"choices": []}\n\n',
    "html": b"<html><body>502 Bad Gateway</body></html>\n",
}


@pytest.mark.parametrize("first", FIRST_EVENTS.values(), ids=FIRST_EVENTS.keys())
async def test_bad_stream_start_is_a_502_and_retried(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine, first: bytes
) -> None:
    router, good = await _router(make_engine, start_router, bad, good=True)
    bad.reply = _sse(bad, [first])
    resp = await router.client.post(COMPLETIONS, json=STREAM)  # bad first, then good
    events = sse_events(resp.text)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pdgate-decode-engine"] == good.url  # type: ignore[union-attr]
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert router.metric("pdgate_retries_total", {"role": "decode"}) == 1


# -- 1. protocol: streams, mid-stream ---------------------------------------------------

MID_STREAM = {
    "garbage line": [EVENT, EVENT, b"data: {not json}\n\n", EVENT, DONE],
    "no [DONE] before eof": [EVENT, EVENT],
    "json array event": [EVENT, b"data: [1, 2]\n\n", DONE],
    "undecodable line": [EVENT, b'data: {"text": "\xff"}\n\n', DONE],
    "split event then garbage": [EVENT, b'data: {"a":', b' 1}\n', b"oops\n\n", DONE],
}


@pytest.mark.parametrize("parts", MID_STREAM.values(), ids=MID_STREAM.keys())
async def test_mid_stream_garbage_ends_with_an_error_event_then_done(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine,
    parts: list[bytes],
) -> None:
    router, _ = await _router(make_engine, start_router, bad)
    bad.reply = _sse(bad, parts, gap_s=0.05)
    resp = await router.client.post(COMPLETIONS, json=STREAM)
    assert resp.status_code == 200
    events = sse_events(resp.text)  # every event parses: the error is an event of its own
    assert events[0]["choices"][0]["text"] == "x"
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "engine_protocol_error" and bad.url in error["message"]
    assert all("error" not in e for e in events[:-2])
    assert resp.text.count("data: [DONE]\n") == 1


# -- 2. size limits ---------------------------------------------------------------------

async def test_reply_over_the_limit_by_content_length_is_a_502(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, _ = await _router(make_engine, start_router, bad, max_engine_reply_bytes=4096)
    bad.reply = _json(b'{"choices": [{"text": "' + b"x" * 5000 + b'"}]}')
    resp = await router.client.post(COMPLETIONS, json=BODY)
    _assert_502(resp, "engine_reply_too_large", bad.url)


async def test_chunked_reply_over_the_limit_is_cut_off_while_reading(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, _ = await _router(make_engine, start_router, bad, max_engine_reply_bytes=64 * 1024)
    total = 64 * 1024 * 1024

    async def endless(request: web.Request, _b: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)  # chunked: no Content-Length to refuse it by
        with contextlib.suppress(ConnectionError, RuntimeError):
            await bad.write(resp, b'{"choices": [{"text": "')
            while bad.written < total:
                await bad.write(resp, b"x" * 65536)
        return resp

    bad.reply = endless
    resp = await router.client.post(COMPLETIONS, json=BODY)
    _assert_502(resp, "engine_reply_too_large", bad.url)
    await asyncio.sleep(0.2)
    assert bad.cut_off and bad.written < total // 4  # the router stopped reading


async def test_sse_line_over_the_limit_ends_the_stream(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, _ = await _router(make_engine, start_router, bad, max_sse_line_bytes=16 * 1024)
    total = 64 * 1024 * 1024

    async def long_line(request: web.Request, _b: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await bad.write(resp, EVENT)
            await asyncio.sleep(0.05)  # the first event reaches the client first
            await bad.write(resp, b'data: {"choices": [{"text": "')
            while bad.written < total:
                await bad.write(resp, b"y" * 65536)
        return resp

    bad.reply = long_line
    resp = await router.client.post(COMPLETIONS, json=STREAM)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[0]["choices"][0]["text"] == "x"
    assert events[-2]["error"]["code"] == "engine_reply_too_large" and events[-1] == "[DONE]"
    assert len(resp.content) < 64 * 1024  # no part of the long line reached the client
    await asyncio.sleep(0.2)
    assert bad.cut_off and bad.written < total // 4


async def test_first_sse_line_over_the_limit_is_a_502(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, _ = await _router(make_engine, start_router, bad, max_sse_line_bytes=1024)
    bad.reply = _sse(bad, [b'data: {"t": "' + b"z" * 4096 + b'"}\n\n', DONE])
    resp = await router.client.post(COMPLETIONS, json=STREAM)
    _assert_502(resp, "engine_reply_too_large", bad.url)


WEIRD_ERROR_BODIES = {
    "loc not a list": b'{"detail": [{"loc": 5, "msg": "x"}]}',
    "detail of ints": b'{"detail": [1, 2]}',
    "error a string": b'{"error": "boom"}',
    "message an int": b'{"error": {"message": 5}}',
    "nested 5000 deep": b'{"error": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "not utf-8": b'{"error": {"message": "\xff"}}',
    "1 MiB of text": b"e" * (1 << 20),
}


@pytest.mark.parametrize("raw", WEIRD_ERROR_BODIES.values(), ids=WEIRD_ERROR_BODIES.keys())
async def test_weird_error_bodies_are_read_bounded_and_never_crash(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine, raw: bytes
) -> None:
    router, _ = await _router(make_engine, start_router, bad)
    bad.reply = _json(raw, status=400)
    for body in (BODY, STREAM):
        resp = await router.client.post(COMPLETIONS, json=body)
        assert resp.status_code == 400, resp.text
        assert len(resp.content) < 1024


# -- 4. engine 4xx the client did not cause ---------------------------------------------

ROUTER_CAUSED = [401, 403, 404, 405, 407, 421, 426, 431]


@pytest.mark.parametrize("status", ROUTER_CAUSED)
async def test_engine_4xx_the_router_caused_is_a_502(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine, status: int
) -> None:
    router, _ = await _router(make_engine, start_router, bad)
    bad.reply = _error(status, f"engine says {status}")
    resp = await router.client.post(COMPLETIONS, json=BODY)
    _assert_502(resp, "engine_misconfigured", bad.url)
    assert f"HTTP {status}" in resp.json()["error"]["message"]


async def test_engine_auth_failure_is_retried_and_counted(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, good = await _router(make_engine, start_router, bad, good=True,
                                 eject_consecutive_errors=2)
    bad.reply = _error(401, "invalid API key")
    for _ in range(2):
        resp = await router.client.post(COMPLETIONS, json=STREAM)
        assert resp.status_code == 200
        assert resp.headers["x-pdgate-decode-engine"] == good.url  # type: ignore[union-attr]
    assert router.metric("pdgate_breaker_opened_total", {"role": "decode"}) == 1


async def test_decode_400_about_kv_transfer_params_blames_the_engines(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    # P's params were incomplete; D says so. The client never sent kv_transfer_params: the
    # router retries without them (D recomputes the prompt) instead of a 400 to the client.
    router, _ = await _router(make_engine, start_router, bad)

    async def picky(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if "kv_transfer_params" in body:
            return await _error(400, "kv_transfer_params is missing remote_block_ids")(
                request, body)
        return web.json_response({"id": "cmpl-ok", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "recomputed"}]})

    bad.reply = picky
    resp = await router.client.post(COMPLETIONS, json=BODY)
    assert resp.status_code == 200, resp.text
    assert bad.calls == 2
    assert router.metric("pdgate_fallbacks_total", {"reason": "decode_retry"}) == 1


async def test_decode_400_naming_a_missing_param_key_is_a_502(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, _ = await _router(make_engine, start_router, bad)
    bad.reply = _error(422, "field required", param="remote_block_ids")
    resp = await router.client.post(COMPLETIONS, json=BODY)
    _assert_502(resp, "engine_misconfigured", bad.url)
    assert "remote_block_ids" in resp.json()["error"]["message"]


CLIENT_4XX = [
    (400, "max_tokens must be at least 1, got 0", "max_tokens"),
    (400, "This model's maximum context length is 2048 tokens.", None),
    (422, "temperature: Input should be less than or equal to 2", "temperature"),
    (413, "request body too large", None),
    (429, "too many requests", None),
]


@pytest.mark.parametrize(("status", "message", "param"), CLIENT_4XX)
async def test_client_4xx_still_passes_through_and_never_counts(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine,
    status: int, message: str, param: str | None,
) -> None:
    router, _ = await _router(make_engine, start_router, bad, eject_consecutive_errors=1)
    bad.reply = _error(status, message, param)
    for _ in range(2):
        resp = await router.client.post(COMPLETIONS, json=BODY)
        assert resp.status_code == status
        assert resp.json()["error"]["message"] == message
    assert bad.calls == 2  # not retried
    assert router.metric("pdgate_breaker_opened_total", {"role": "decode"}) == 0


async def test_client_cannot_get_its_own_400_blamed_on_the_engine(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    # The engine echoes the client's value, which names a router field: still the client's.
    router, _ = await _router(make_engine, start_router, bad, eject_consecutive_errors=1)
    bad.reply = _error(400, "stop: invalid value 'kv_transfer_params remote_block_ids'",
                       "stop")
    body = {**BODY, "stop": "kv_transfer_params remote_block_ids"}
    for _ in range(2):
        resp = await router.client.post(COMPLETIONS, json=body)
        assert resp.status_code == 400
    assert router.metric("pdgate_breaker_opened_total", {"role": "decode"}) == 0


async def test_prefill_401_is_a_502_not_the_clients_401(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine(engine_id="P0", fail_status=401)
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d])
    resp = await router.client.post(COMPLETIONS, json=BODY)
    _assert_502(resp, "engine_misconfigured", p.url)
    assert d.requests == []


# -- the stream listener (how mid-stream failures reach the engine's breaker) ------------

async def test_stream_listener_hears_how_each_stream_ended(bad: HostileEngine) -> None:
    config = RouterConfig(model="m", prefill=["http://p"], decode=[bad.url],
                          max_sse_line_bytes=1024)
    heard: list[tuple[str, RouterError | None]] = []
    client = EngineClient.create(config)
    try:
        client.set_stream_listener(lambda url, exc: heard.append((url, exc)))
        for parts, expected in (
            ([EVENT, DONE], None),
            ([EVENT, b"data: nope\n\n", DONE], EngineProtocolError),
            ([EVENT, b"data: " + b"x" * 2048], EngineReplyTooLarge),
            ([EVENT], EngineProtocolError),  # no [DONE]
        ):
            bad.reply = _sse(bad, parts, gap_s=0.02)
            stream = await client.open_stream(bad.url, COMPLETIONS, b"{}", {})
            await stream.check_start(5.0)
            got = b""
            try:
                async for chunk in stream.chunks():
                    got += chunk
            except RouterError:
                pass
            finally:
                stream.close()
            assert got.startswith(EVENT)
            url, exc = heard.pop()
            assert url == bad.url
            if expected is None:
                assert exc is None
            else:
                assert type(exc) is expected
        assert heard == []
    finally:
        await client.close()


async def test_mid_stream_faults_open_the_breaker(
    make_engine: MakeEngine, start_router: StartRouter, bad: HostileEngine
) -> None:
    router, _ = await _router(make_engine, start_router, bad, good=True,
                              eject_consecutive_errors=2)
    bad.reply = _sse(bad, [EVENT, EVENT], gap_s=0.02)  # valid events, then no [DONE]
    for _ in range(4):  # round-robin: bad, good, bad, good
        resp = await router.client.post(COMPLETIONS, json=STREAM)
        assert resp.status_code == 200
    assert bad.calls == 2
    assert router.metric("pdgate_breaker_opened_total", {"role": "decode"}) == 1
