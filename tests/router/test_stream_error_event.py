"""A decode engine that starts a stream with an SSE error event (what real vLLM does when
handed KV params it cannot use: HTTP 200, one `data: {"error": ...}` event, `[DONE]`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from tests.router.conftest import RunningRouter
from tests.router.fake_engine import FakeEngine, Recorded


class ErrorEventEngine(FakeEngine):
    """Answers every streaming decode with 200 and an error event, like vLLM."""

    async def _stream(self, request: web.Request, rec: Recorded, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        err = {"error": {"message": "Internal server error", "type": "InternalServerError",
                         "param": None, "code": 500}}
        await resp.write(b"data: " + web.json_response(err).body + b"\n\n")  # type: ignore[operator]
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def error_engine() -> AsyncIterator[ErrorEventEngine]:
    engine = ErrorEventEngine(engine_id="D-bad")
    await engine.start()
    yield engine
    await engine.stop()


BODY: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True}


async def test_error_event_before_any_token_is_a_502(
    make_engine: Callable[..., Awaitable[FakeEngine]],
    start_router: Callable[..., Awaitable[RunningRouter]],
    error_engine: ErrorEventEngine,
) -> None:
    p = await make_engine(engine_id="P0")
    router = await start_router([p], [error_engine])
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "engine_error"
    assert "Internal server error" in resp.json()["error"]["message"]
    # The router keeps serving.
    assert (await router.client.get("/health")).status_code == 200


async def test_error_event_is_retried_on_another_decode_engine(
    make_engine: Callable[..., Awaitable[FakeEngine]],
    start_router: Callable[..., Awaitable[RunningRouter]],
    error_engine: ErrorEventEngine,
) -> None:
    p = await make_engine(engine_id="P0")
    good = await make_engine(engine_id="D-good")
    router = await start_router([p], [error_engine, good], decode_policy="round-robin")
    resp = await router.client.post("/v1/completions", json=BODY)  # round-robin: bad first
    assert resp.status_code == 200
    assert b"[DONE]" in resp.content and b'"error"' not in resp.content
    assert resp.headers["x-pdgate-decode-engine"] == good.url
    assert len(error_engine.decodes) == 1 and len(good.decodes) == 1
    assert router.metric("pdgate_retries_total", {"role": "decode"}) == 1
