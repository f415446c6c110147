"""Pass-through routes (router/http/passthrough.py): vLLM's embeddings, rerank, score,
responses, tokenize, detokenize and version routes reach one healthy decode engine (no
P/D) with the completions' keys, limits, admission and metrics; other /v1 paths stay 404."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import MODEL, RunningRouter, sse_events, wait_until_ready
from tests.router.fake_engine import VLLM_OTHER_ROUTES, FakeEngine
from tests.router.test_config import free_port

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
ROOT = Path(__file__).parents[2]
KEY = "client-key-123"


async def call(client: httpx.AsyncClient, method: str, path: str, **kw: object
               ) -> httpx.Response:
    body = {"model": MODEL, "input": "hi"} if method == "POST" else None
    return await client.request(method, path, json=body, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("method", "path"), VLLM_OTHER_ROUTES)
async def test_each_route_reaches_one_decode_engine(
    make_engine: MakeEngine, start_router: StartRouter, method: str, path: str
) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    router = await start_router([p], [d], served_model_name=[MODEL, "alias"],
                                engine_model_name=MODEL)
    resp = await call(router.client, method, path, headers={"x-request-id": "mine"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["path"] == path and resp.json()["engine"] == "D0"
    assert resp.headers["x-request-id"] == "mine"
    assert resp.headers["x-pdgate-decode-engine"] == d.url
    assert not p.requests and len(d.requests) == 1
    assert d.requests[0].headers["x-request-id"] != "mine"  # the router's own id
    assert router.metric("pdgate_requests_total", {"route": path, "status": "200"}) == 1


async def test_alias_rewritten_unknown_model_404_and_bad_json_400(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], served_model_name=[MODEL, "alias"],
                                engine_model_name=MODEL)
    ok = await router.client.post("/v1/embeddings", json={"model": "alias", "input": "x"})
    assert ok.json()["model"] == MODEL
    missing = await router.client.post("/v1/embeddings", json={"model": "gpt-9", "input": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = await router.client.post("/v1/embeddings", content=b"{nope")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    deep = await router.client.post("/v1/embeddings", content=b"[" * 100 + b"]" * 100)
    assert deep.status_code == 400
    big = await router.client.post("/v1/embeddings", content=b" " * (5 * 1024 * 1024))
    assert big.status_code == 413
    assert len(d.requests) == 1


async def test_keys_and_unknown_routes(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], api_key=KEY)
    assert (await call(router.client, "POST", "/v1/embeddings")).status_code == 401
    ok = await call(router.client, "POST", "/v1/embeddings",
                    headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    unknown = await router.client.post("/v1/frobnicate", json={},
                                       headers={"Authorization": f"Bearer {KEY}"})
    assert unknown.status_code == 404


async def test_engine_errors_pass_through_and_a_dead_engine_is_a_502(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine(fail_status=400, fail_message="bad input")
    router = await start_router([p], [d])
    resp = await call(router.client, "POST", "/v1/rerank")
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "bad input"
    await d.stop()
    gone = await call(router.client, "POST", "/v1/rerank")
    assert gone.status_code == 502 and gone.json()["error"]["code"] == "engine_unavailable"


async def test_streamed_responses_and_the_prefill_role(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    router = await start_router([p], [d], passthrough_role="prefill")
    resp = await router.client.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                           "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert [e["part"] for e in events[:-1]] == ["a", "b"] and events[-1] == "[DONE]"
    assert len(p.requests) == 1 and not d.requests


async def test_admission_applies(make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d = await make_engine(), await make_engine(delay_s=0.5)
    router = await start_router([p], [d], max_concurrent_requests=1, max_queued_requests=0)
    slow = asyncio.create_task(router.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}))
    while not d.requests:
        await asyncio.sleep(0.01)
    refused = await call(router.client, "POST", "/v1/embeddings")
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert (await slow).status_code == 200
    assert (await call(router.client, "POST", "/v1/embeddings")).status_code == 200


async def test_a_router_process_serves_them(make_engine: MakeEngine) -> None:
    p, d = await make_engine(), await make_engine(engine_id="D0")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgate.router", "--model", MODEL, "--prefill", p.url,
        "--decode", d.url, "--port", str(port), "--log-level", "warning", cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await wait_until_ready(client, proc)
            for method, path in VLLM_OTHER_ROUTES:
                resp = await call(client, method, path)
                assert resp.status_code == 200 and resp.json()["engine"] == "D0", path
            assert (await client.post("/v1/unknown", json={})).status_code == 404
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
