"""Failures a client can see: bad input (4xx), dead or slow engines (5xx), retries."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.router.conftest import MODEL, RunningRouter, sse_events
from tests.router.fake_engine import FakeEngine
from tests.router.test_pull_flow import PD

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]

BAD_INPUTS: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, body (str = raw bytes), status, expected param)
    ("not json", COMPLETIONS, "{not json", 400, None),
    ("json array", COMPLETIONS, "[1, 2]", 400, None),
    ("missing prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    ("zero max_tokens", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400,
     "max_tokens"),
    ("negative max_tokens", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": -5},
     400, "max_tokens"),
    ("string max_tokens", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": "ten"},
     400, "max_tokens"),
    ("temperature too high", COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": 3},
     400, "temperature"),
    ("negative temperature", CHAT, {"model": MODEL, "messages": HI, "temperature": -0.1},
     400, "temperature"),
    ("top_p zero", COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n zero", COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("stream not bool", COMPLETIONS, {"model": MODEL, "prompt": "x", "stream": "yes"}, 400,
     "stream"),
    ("prompt object", COMPLETIONS, {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("prompt empty list", COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("prompt mixed list", COMPLETIONS, {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt"),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("messages not list", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("message without role", CHAT, {"model": MODEL, "messages": [{"content": "x"}]}, 400,
     "messages[0].role"),
    ("role not str", CHAT, {"model": MODEL, "messages": [{"role": 1}]}, 400,
     "messages[0].role"),
    ("context too long", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 5000},
     400, "max_tokens"),
    ("unknown model", COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("unknown model chat", CHAT, {"model": "gpt-9", "messages": HI}, 404, "model"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
async def test_bad_input_gets_openai_error(
    pd: PD, path: str, body: Any, status: int, param: str | None
) -> None:
    p, d, router = pd
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    resp = await router.client.post(path, content=content,
                                    headers={"Content-Type": "application/json"})
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["param"] == param
    if status == 404:
        assert (err["type"], err["code"]) == ("NotFoundError", "model_not_found")
    else:
        assert err["type"] == "BadRequestError"
    assert p.requests == [] and d.requests == []
    assert router.metric("pdgate_requests_total", {"route": path, "status": str(status)}) == 1


async def test_context_length_error_is_explicit(pd: PD) -> None:
    p, d, router = pd
    resp = await router.client.post(
        COMPLETIONS, json={"model": MODEL, "prompt": "hello " * 10, "max_tokens": 4090})
    err = resp.json()["error"]
    assert resp.status_code == 400
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in err["message"]


async def test_oversized_body_is_413(make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], max_body_bytes=1000)
    body = {"model": MODEL, "prompt": "x" * 2000}
    resp = await router.client.post(COMPLETIONS, json=body)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "payload_too_large"

    async def chunked() -> Any:  # no Content-Length: the limit must still hold
        for _ in range(4):
            yield b" " * 400

    resp = await router.client.post(COMPLETIONS, content=chunked())
    assert resp.status_code == 413
    assert p.requests == [] and d.requests == []


async def test_unknown_route_and_method_get_error_bodies(pd: PD) -> None:
    p, d, router = pd
    resp = await router.client.get("/v1/nothing")
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "NotFoundError"
    resp = await router.client.get(COMPLETIONS)
    assert resp.status_code == 405
    assert "error" in resp.json()


async def test_dead_prefill_engine_is_retried_on_the_other(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p0, p1, d = await make_engine(), await make_engine(), await make_engine()
    router = await start_router([p0, p1], [d], prefill_policy="round-robin")
    await p0.stop()  # healthy at startup, dead now
    for _ in range(3):
        resp = await router.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 200
    assert len(p1.prefills) == 3
    assert router.metric("pdgate_retries_total", {"role": "prefill"}) == 1
    labels = {"engine": p0.url, "role": "prefill"}
    assert router.metric("pdgate_engine_healthy", labels) == 0  # marked down on connect


async def test_prefill_5xx_is_retried_on_the_other(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p0, p1, d = await make_engine(fail_status=500), await make_engine(), await make_engine()
    router = await start_router([p0, p1], [d], prefill_policy="round-robin")
    resp = await router.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 200
    assert len(p0.requests) == 1 and len(p1.requests) == 1
    assert p0.requests[0].headers["X-Request-Id"] == p1.requests[0].headers["X-Request-Id"]
    assert router.metric("pdgate_retries_total", {"role": "prefill"}) == 1


async def test_decode_dead_is_retried_before_first_byte(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d0, d1 = await make_engine(), await make_engine(), await make_engine()
    router = await start_router([p], [d0, d1], decode_policy="round-robin")
    await d0.stop()
    body = {"model": MODEL, "prompt": "x", "stream": True}
    resp = await router.client.post(COMPLETIONS, json=body)
    assert resp.status_code == 200
    assert sse_events(resp.text)[-1] == "[DONE]"
    assert d1.decodes[0].body["kv_transfer_params"] == p.kv_params(p.prefills[0])
    assert router.metric("pdgate_retries_total", {"role": "decode"}) == 1


async def test_only_engine_5xx_gives_502(pd: PD) -> None:
    p, d, router = pd
    p.fail_status = 500
    resp = await router.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 502
    err = resp.json()["error"]
    assert err["code"] == "engine_error" and "HTTP 500" in err["message"]
    assert d.requests == []


async def test_all_prefill_dead_falls_back_to_decode_only(pd: PD) -> None:
    p, d, router = pd
    await p.stop()
    for _ in range(2):  # first: connect fails, P marked down; then: no P at all
        resp = await router.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 200
    assert [r.body.get("kv_transfer_params") for r in d.decodes] == [None, None]
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_prefill"}) == 2
    assert (await router.client.get("/ready")).status_code == 503


async def test_engine_4xx_is_passed_through(pd: PD) -> None:
    p, d, router = pd
    d.fail_status = 400
    resp = await router.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "fake failure 400"
    assert len(d.requests) == 1  # a client error is not retried


async def test_prefill_timeout_gives_504(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(delay_s=5), await make_engine()
    router = await start_router([p], [d], prefill_timeout_s=0.2)
    resp = await router.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "engine_timeout"
    assert d.requests == []


async def test_decode_first_byte_timeout_gives_504(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine(delay_s=5)
    router = await start_router([p], [d], decode_first_byte_timeout_s=0.2)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "x", "stream": stream}
        resp = await router.client.post(COMPLETIONS, json=body)
        assert resp.status_code == 504
        assert resp.json()["error"]["type"] == "GatewayTimeoutError"


async def test_failure_after_first_byte_ends_stream_with_error_event(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine(token_delay_s=5)
    router = await start_router([p], [d], decode_idle_timeout_s=0.2)
    body = {"model": MODEL, "prompt": "x", "stream": True}
    resp = await router.client.post(COMPLETIONS, json=body)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[0]["choices"][0]["text"] == "Hello"
    assert events[1]["error"]["code"] == "engine_timeout"
    assert events[2] == "[DONE]"
    assert len(events) == 3
    assert router.metric("pdgate_engine_in_flight", {"engine": d.url, "role": "decode"}) == 0
