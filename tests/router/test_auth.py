"""API keys: Bearer on /v1/*, a separate admin key, open ops endpoints, no secret in logs,
and engine requests that never follow redirects."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from pdgate.router.http.auth import bearer_matches
from pdgate.router.input.tokenization import PromptTokenizer
from tests.router.conftest import MODEL, RunningRouter, router_config, serve
from tests.router.test_errors import COMPLETIONS, MakeEngine, StartRouter

KEY = "sk-client-key-123"
ADMIN = "sk-admin-key-456"
BODY = {"model": MODEL, "prompt": "x"}


@pytest.fixture
async def keyed(make_engine: MakeEngine, start_router: StartRouter) -> RunningRouter:
    p, d = await make_engine(), await make_engine()
    return await start_router([p], [d], api_key=KEY, admin_api_key=ADMIN)


def test_bearer_matches() -> None:
    assert bearer_matches(b"Bearer k3y", b"k3y")
    assert bearer_matches(b"bearer  k3y ", b"k3y")
    for bad in (None, b"", b"k3y", b"Basic k3y", b"Bearer k3", b"Bearer k3yy", b"Bearer"):
        assert not bearer_matches(bad, b"k3y")


async def test_openai_routes_need_the_key(keyed: RunningRouter) -> None:
    c = keyed.client
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {ADMIN}"},
                    {"Authorization": KEY}):
        resp = await c.post(COMPLETIONS, json=BODY, headers=headers)
        assert resp.status_code == 401
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        err = resp.json()["error"]
        assert err["type"] == "AuthenticationError" and err["code"] == "invalid_api_key"
        assert KEY not in resp.text
    assert (await c.get("/v1/models")).status_code == 401
    ok = {"Authorization": f"Bearer {KEY}"}
    assert (await c.post(COMPLETIONS, json=BODY, headers=ok)).status_code == 200
    assert (await c.get("/v1/models", headers=ok)).status_code == 200


async def test_ops_endpoints_stay_open(keyed: RunningRouter) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert (await keyed.client.get(path)).status_code == 200


async def test_admin_routes_need_the_admin_key(keyed: RunningRouter) -> None:
    c = keyed.client
    assert (await c.get("/admin/engines")).status_code == 401
    client_key = {"Authorization": f"Bearer {KEY}"}
    assert (await c.get("/admin/engines", headers=client_key)).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert (await c.get("/admin/engines", headers=admin)).status_code == 200


async def test_no_secret_in_logs_or_admin_config(
    keyed: RunningRouter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    c = keyed.client
    await c.post(COMPLETIONS, json=BODY, headers={"Authorization": "Bearer guess"})
    await c.post(COMPLETIONS, json=BODY, headers={"Authorization": f"Bearer {KEY}"})
    config = (await c.get("/admin/config", headers={"Authorization": f"Bearer {ADMIN}"}))
    assert config.json()["api_key"] == config.json()["admin_api_key"] == "<redacted>"
    assert KEY not in config.text and ADMIN not in config.text
    assert KEY not in caplog.text and ADMIN not in caplog.text


@pytest.fixture
async def redirecting() -> AsyncIterator[tuple[str, list[str]]]:
    """An 'engine' that redirects every request to a path it records hits on."""
    hits: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.json_response({})
        if request.path.startswith("/target"):
            hits.append(request.path)
            return web.json_response({})
        raise web.HTTPTemporaryRedirect("/target" + request.path)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", redirect)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", hits
    finally:
        await runner.cleanup()


async def test_engine_redirects_are_not_followed(
    make_engine: MakeEngine, tiny_model_dir: Path, tokenizer: PromptTokenizer,
    redirecting: tuple[str, list[str]],
) -> None:
    url, hits = redirecting
    p = await make_engine()
    d = await make_engine()
    config = router_config(tiny_model_dir, [p], [d], max_retries=0)
    config = msgspec.structs.replace(config, decode=[url])
    async with serve(config, tokenizer) as router:
        resp = await router.client.post(COMPLETIONS, json=BODY)
        assert resp.status_code == 502
        assert "redirects are not followed" in resp.json()["error"]["message"]
        stream = await router.client.post(COMPLETIONS, json={**BODY, "stream": True})
        assert stream.status_code == 502
    assert hits == []


async def test_every_configured_client_key_works_and_others_fail(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], api_keys=["sk-first-key-1", "sk-second-key-2"])
    c = router.client
    assert (await c.post(COMPLETIONS, json=BODY)).status_code == 401
    for key in ("sk-first-key-1", "sk-second-key-2"):
        ok = await c.post(COMPLETIONS, json=BODY, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    bad = await c.post(COMPLETIONS, json=BODY, headers={"Authorization": "Bearer sk-first"})
    assert bad.status_code == 401


async def test_dashboard_needs_the_admin_key(keyed: RunningRouter) -> None:
    c = keyed.client
    for path in ("/dashboard", "/dashboard/state"):
        refused = await c.get(path)
        assert refused.status_code == 401
        assert refused.headers["WWW-Authenticate"].startswith("Basic")
        assert "127.0.0.1" not in refused.text  # no engine address leaks
        assert (await c.get(path, headers={"Authorization": f"Bearer {KEY}"})).status_code == 401
        assert (await c.get(path, auth=("ops", "wrong-password"))).status_code == 401
        # A browser sends the admin key as HTTP Basic password (any user name).
        assert (await c.get(path, auth=("ops", ADMIN))).status_code == 200
        ok = await c.get(path, headers={"Authorization": f"Bearer {ADMIN}"})
        assert ok.status_code == 200


async def test_engine_key_is_sent_on_every_engine_call(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], engine_api_key="sk-engine-key-9")
    resp = await router.client.post(COMPLETIONS, json=BODY)
    assert resp.status_code == 200
    seen = p.auth_seen + d.auth_seen
    assert {path for path, _ in seen} >= {"/health", "/v1/completions"}
    assert {auth for _, auth in seen} == {"Bearer sk-engine-key-9"}
