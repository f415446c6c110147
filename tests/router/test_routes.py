"""One route table: every route the router serves is listed by the app, each one (and the
404/405 answers) passes the same middlewares, and every declared handler can run."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pdgate.router.http.app import create_app
from pdgate.router.http.routes import Route, RouteTable, no_lifespan
from pdgate.router.input.tokenization import PromptTokenizer
from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
CLIENT_KEY = "client-key-0123"
ADMIN_KEY = "admin-key-0123"
KEYS = {"api_key": CLIENT_KEY, "admin_api_key": ADMIN_KEY}


def _key_for(path: str) -> str | None:
    if path.startswith("/v1/"):
        return CLIENT_KEY
    if path.startswith(("/admin", "/dashboard")):
        return ADMIN_KEY
    return None  # probes and scrapes stay open


def _url(route: Route) -> str:
    return route.path.replace("{model:path}", MODEL)


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, int]]:
    fields = [getattr(r, "fields", {}) for r in caplog.records
              if r.name == "pdgate.router.access"]
    return [(f["method"], f["path"], f["status"]) for f in fields]


async def _send(client: httpx.AsyncClient, route: Route, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = b"{}" if route.method in ("POST", "PUT", "PATCH") else None
    return await client.request(route.method, _url(route), headers=headers, content=body)


async def test_every_route_passes_the_same_middlewares_and_can_run(
    make_engine: MakeEngine, start_router: StartRouter, tiny_model_dir: Path,
    tokenizer: PromptTokenizer, caplog: pytest.LogCaptureFixture,
) -> None:
    router = await start_router([await make_engine()], [await make_engine()], **KEYS)
    routes = create_app(router.config, registry=CollectorRegistry(), tokenizer=tokenizer).routes
    listed = {(r.method, r.path) for r in routes}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"), ("GET", "/v1/models/{model:path}"), ("GET", "/health"),
            ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/dashboard"),
            ("GET", "/dashboard/state"), ("GET", "/admin/engines"), ("POST", "/admin/engines"),
            ("DELETE", "/admin/engines"), ("GET", "/admin/config")} <= listed
    assert len(listed) == len(routes)  # no route declared twice
    caplog.set_level(logging.DEBUG, logger="pdgate.router.access")
    for route in routes:
        caplog.clear()
        key = _key_for(route.path)
        if key is not None:  # the keys are checked on every guarded route
            refused = await _send(router.client, route, None)
            assert refused.status_code == 401, (route, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
        answered = await _send(router.client, route, key)
        # The handler ran: not the table's own 404 or 405.
        assert answered.status_code != 405, route
        if answered.status_code == 404:
            assert answered.json()["error"]["message"] != "Not Found", route
        # The access log saw each request once, with the status the client saw.
        seen = [(route.method, _url(route), 401)] if key else []
        assert _access_lines(caplog) == [*seen, (route.method, _url(route),
                                                 answered.status_code)], route


async def test_unrouted_requests_pass_the_middlewares_too(
    make_engine: MakeEngine, start_router: StartRouter, caplog: pytest.LogCaptureFixture,
) -> None:
    router = await start_router([await make_engine()], [await make_engine()], **KEYS)
    caplog.set_level(logging.DEBUG, logger="pdgate.router.access")
    assert (await router.client.get("/v1/nothing")).status_code == 401  # keys before routing
    bearer = {"Authorization": f"Bearer {CLIENT_KEY}"}
    missing = await router.client.get("/v1/nothing", headers=bearer)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    wrong = await router.client.get("/v1/completions", headers=bearer)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert (await router.client.head("/health")).status_code == 200
    slash = await router.client.get("/health/?x=1")
    assert slash.status_code == 307 and slash.headers["location"] == "/health?x=1"
    assert _access_lines(caplog) == [
        ("GET", "/v1/nothing", 401), ("GET", "/v1/nothing", 404),
        ("GET", "/v1/completions", 405), ("HEAD", "/health", 200), ("GET", "/health/", 307)]


def test_a_route_declared_twice_or_with_a_bad_path_is_refused() -> None:
    async def endpoint(request: Request) -> Response:
        return Response(b"")

    table = RouteTable()
    table.add("POST", "/v1/completions", endpoint)
    with pytest.raises(ValueError, match="declared twice"):
        table.add("post", "/v1/completions", endpoint)
    for bad in ("/v1/{model}", "v1/x", "/v1/{a}/{b:path}"):
        with pytest.raises(ValueError, match="exact, or ending in one"):
            table.add("GET", bad, endpoint)


async def test_an_endpoint_that_raises_is_a_logged_500_and_a_client_gone_a_quiet_499(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(request: Request) -> Response:
        raise KeyError("bug")

    async def gone(request: Request) -> Response:
        raise ClientDisconnect()

    table = RouteTable()
    table.add("GET", "/broken", broken)
    table.add("GET", "/gone", gone)
    app = table.app([], no_lifespan)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        with caplog.at_level(logging.ERROR, logger="pdgate.router.http.routes"):
            resp = await client.get("/broken")
            assert resp.status_code == 500
            assert resp.json()["error"]["message"] == "internal router error"
            assert [r.getMessage() for r in caplog.records] == ["GET /broken failed"]
            caplog.clear()
            assert (await client.get("/gone")).status_code == 499
            assert caplog.records == []


async def test_an_explicit_head_route_and_the_longest_prefix_win() -> None:
    def answer(text: bytes) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return Response(text + request.path_params.get("rest", "").encode(),
                            headers={"X-Which": text.decode()})
        return endpoint

    table = RouteTable()
    table.add("GET", "/page", answer(b"get"))
    table.add("HEAD", "/page", answer(b"head"))
    table.add("GET", "/v1/{rest:path}", answer(b"short:"))
    table.add("GET", "/v1/models/{rest:path}", answer(b"long:"))
    transport = httpx.ASGITransport(app=table.app([], no_lifespan))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        assert (await client.head("/page")).headers["x-which"] == "head"
        assert (await client.get("/page")).text == "get"
        assert (await client.get("/v1/models/org/m")).text == "long:org/m"
        assert (await client.get("/v1/other")).text == "short:other"
