"""vllm-router's `--request-id-headers` and `--cors-allowed-origins` on a serving router:
the client's id comes from the first configured header present; browsers get their
preflight answered and CORS headers on answers, only for allowed origins."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(("headers", "echoed"), [
    ({"x-request-id": "a1"}, "a1"),
    ({"x-correlation-id": "c2"}, "c2"),
    ({"x-trace-id": "t3"}, "t3"),
    ({"request-id": "r4"}, "r4"),
    ({"request-id": "r4", "x-correlation-id": "c2"}, "c2"),  # the first in the list wins
])
async def test_default_request_id_headers(
    make_engine: MakeEngine, start_router: StartRouter, headers: dict[str, str], echoed: str
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d])
    resp = await router.client.post("/v1/completions", json=BODY, headers=headers)
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == echoed
    assert d.requests[-1].headers["x-request-id"] != echoed  # engines get the router's id


async def test_configured_request_id_headers(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], request_id_headers=["X-My-Id"])
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"x-my-id": "mine", "x-request-id": "other"})
    assert resp.headers["x-request-id"] == "mine"
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"x-request-id": "other"})
    assert resp.headers["x-request-id"] != "other"  # not a configured header


async def test_cors_preflight_and_response_headers(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], cors_allowed_origins=["https://app.example"],
                                api_key="client-key-123")
    preflight = await router.client.options("/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200  # no key needed: browsers send none on preflight
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    resp = await router.client.post("/v1/completions", json=BODY, headers={
        "Origin": "https://app.example", "Authorization": "Bearer client-key-123"})
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == "https://app.example"
    other = await router.client.options("/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


async def test_no_cors_unless_configured(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d])
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in resp.headers
