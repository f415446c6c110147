"""Several models behind one router (router/served_models.py): requests go by their `model`
to that model's engines only; each model has its own mode; `/v1/models` and `/ready` answer
per model. Fake engines on loopback sockets, the router under uvicorn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest

from pdgate.router.config import ModelConfig, RouterConfig
from pdgate.router.input.tokenization import PromptTokenizer
from tests.router.conftest import RunningRouter, serve, sse_events
from tests.router.fake_engine import FakeEngine

Start = Callable[..., Awaitable[RunningRouter]]


@pytest.fixture
async def start_models(tokenizer: PromptTokenizer) -> AsyncIterator[Start]:
    async with AsyncExitStack() as stack:

        async def start(models: list[ModelConfig], **kw: Any) -> RunningRouter:
            config = RouterConfig(models=models, **{"health_interval_s": 3600.0, **kw})
            return await stack.enter_async_context(serve(config, tokenizer))

        yield start


def engines_seen(*engines: FakeEngine) -> list[tuple[str, str, bool]]:
    """(engine, model in the body, prefill leg?) of every completion leg received."""
    return [(e.engine_id, r.body.get("model"), r.is_prefill) for e in engines
            for r in e.requests if r.path.endswith("completions")]


async def two_models(make_engine: Callable[..., Awaitable[FakeEngine]], start: Start,
                     **kw: Any) -> tuple[RunningRouter, list[FakeEngine]]:
    """Model `alpha` on P/D (pull) with an alias, model `beta` colocated."""
    pa = await make_engine(engine_id="PA", tokens=("a1", "a2"))
    da = await make_engine(engine_id="DA", tokens=("a1", "a2"))
    db = await make_engine(engine_id="DB", tokens=("b1", "b2", "b3"))
    router = await start([
        ModelConfig(model="org/alpha", served_model_name=["alpha", "alpha-alias"],
                    prefill=[pa.url], decode=[da.url], max_model_len=2048),
        ModelConfig(model="beta", decode=[db.url], pd_mode="colocated", max_model_len=512),
    ], **kw)
    return router, [pa, da, db]


async def test_each_request_reaches_only_its_models_engines(
    make_engine: Callable[..., Awaitable[FakeEngine]], start_models: Start,
) -> None:
    router, (pa, da, db) = await two_models(make_engine, start_models)
    a = await router.client.post("/v1/completions", json={
        "model": "alpha-alias", "prompt": "hi", "max_tokens": 4})
    assert a.status_code == 200, a.text
    assert a.json()["choices"][0]["text"] == "a1a2"
    assert a.headers["X-Pdgate-Prefill-Engine"] == pa.url
    assert a.headers["X-Pdgate-Decode-Engine"] == da.url
    b = await router.client.post("/v1/chat/completions", json={
        "model": "beta", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert b.status_code == 200, b.text
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(b.text)
                   if isinstance(e, dict) and e["choices"])
    assert text == "b1b2b3"
    assert "X-Pdgate-Prefill-Engine" not in b.headers  # colocated: one engine, no P leg
    # The alias went to the engines under the first served name; beta never saw P/D.
    assert engines_seen(pa, da, db) == [("PA", "alpha", True), ("DA", "alpha", False),
                                        ("DB", "beta", False)]
    assert router.metric("pdgate_disagg_decisions_total",
                         {"model": "beta", "reason": "colocated"}) == 1


async def test_unknown_model_is_404_model_not_found(
    make_engine: Callable[..., Awaitable[FakeEngine]], start_models: Start,
) -> None:
    router, engines = await two_models(make_engine, start_models)
    for path, body in (("/v1/completions", {"model": "gamma", "prompt": "x"}),
                       ("/v1/chat/completions",
                        {"model": "gamma", "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/embeddings", {"model": "gamma", "input": "x"})):
        r = await router.client.post(path, json=body)
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model", err
        assert "gamma" in err["message"]
    assert (await router.client.get("/v1/models/gamma")).status_code == 404
    assert (await router.client.get("/ready?model=gamma")).json()["error"]["code"] == \
        "model_not_found"
    assert engines_seen(*engines) == []


async def test_passthrough_goes_to_the_models_engines(
    make_engine: Callable[..., Awaitable[FakeEngine]], start_models: Start,
) -> None:
    router, (pa, da, db) = await two_models(make_engine, start_models)
    r = await router.client.post("/v1/embeddings", json={"model": "beta", "input": "x"})
    assert r.status_code == 200 and r.json()["engine"] == "DB", r.text
    r = await router.client.post("/tokenize", json={"model": "alpha-alias", "prompt": "x"})
    assert r.status_code == 200 and r.json()["engine"] == "DA", r.text
    assert r.json()["model"] == "alpha"  # the alias rewritten to the engines' name
    assert [len(e.requests) for e in (pa, da, db)] == [0, 1, 1]


async def test_models_and_ready_follow_each_pool(
    make_engine: Callable[..., Awaitable[FakeEngine]], start_models: Start,
) -> None:
    router, (pa, da, db) = await two_models(make_engine, start_models,
                                            health_interval_s=0.05)
    cards = (await router.client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["root"], c["parent"], c["max_model_len"], c["ready"])
            for c in cards] == [("alpha", "org/alpha", None, 2048, True),
                                ("alpha-alias", "org/alpha", None, 2048, True),
                                ("beta", "beta", None, 512, True)]
    ready = await router.client.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["models"]["beta"] == {"ready": True, "prefill_healthy": 0,
                                              "decode_healthy": 1, "pd_mode": "colocated"}
    # beta's only engine goes down: the router is not ready, alpha still is.
    db.health_status = 503
    await _ready_becomes(router, 503)
    ready = await router.client.get("/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "not ready"
    assert ready.json()["models"]["beta"]["ready"] is False
    assert ready.json()["models"]["alpha"]["ready"] is True
    assert (await router.client.get("/ready?model=alpha-alias")).status_code == 200
    one = await router.client.get("/ready?model=beta")
    assert one.status_code == 503 and list(one.json()["models"]) == ["beta"]
    card = (await router.client.get("/v1/models/beta")).json()
    assert card["id"] == "beta" and card["ready"] is False
    # alpha keeps serving while beta is down; beta's requests get a clear 503.
    ok = await router.client.post("/v1/completions", json={"model": "alpha", "prompt": "x"})
    assert ok.status_code == 200, ok.text
    down = await router.client.post("/v1/completions", json={"model": "beta", "prompt": "x"})
    assert down.status_code == 503, down.text
    assert down.json()["error"]["message"]
    assert db.decodes == [] or all(r.body.get("model") == "beta" for r in db.requests)
    db.health_status = 200
    await _ready_becomes(router, 200)
    assert (await router.client.get("/ready?model=beta")).status_code == 200


async def _ready_becomes(router: RunningRouter, status: int) -> None:
    """Poll `/ready` (the health checks run every 50 ms here) until it answers `status`."""
    for _ in range(200):
        if (await router.client.get("/ready")).status_code == status:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"/ready never answered {status}")


async def test_series_carry_the_model_and_one_engine_serves_both(
    make_engine: Callable[..., Awaitable[FakeEngine]], start_models: Start,
) -> None:
    """With several models every per-request and per-engine series has a `model` label
    (requests refused before a model is known: model ""); one engine URL in both models'
    pools is one series per model."""
    p = await make_engine(engine_id="P")
    shared = await make_engine(engine_id="D")
    router = await start_models([
        ModelConfig(model="alpha", prefill=[p.url], decode=[shared.url]),
        ModelConfig(model="beta", decode=[shared.url], pd_mode="colocated"),
    ])
    # A stream each (their TTFTs), and a whole answer of beta's (no first token seen)
    for model, stream in (("alpha", True), ("beta", True), ("beta", False)):
        r = await router.client.post("/v1/completions",
                                     json={"model": model, "prompt": "x", "stream": stream})
        assert r.status_code == 200, r.text
    assert (await router.client.post("/v1/completions", json={
        "model": "gamma", "prompt": "x"})).status_code == 404
    route = "/v1/completions"
    count = router.metric
    assert count("pdgate_requests_total",
                 {"model": "alpha", "route": route, "status": "200"}) == 1
    assert count("pdgate_requests_total",
                 {"model": "beta", "route": route, "status": "200"}) == 2
    assert count("pdgate_requests_total", {"model": "", "route": route, "status": "404"}) == 1
    assert count("pdgate_disagg_decisions_total", {"model": "beta", "reason": "colocated"}) == 2
    assert count("pdgate_disagg_decisions_total", {"model": "alpha", "reason": "disagg"}) == 1
    assert count("pdgate_prefill_duration_seconds_count", {"model": "alpha"}) == 1
    for model in ("alpha", "beta"):
        assert count("pdgate_engine_healthy",
                     {"model": model, "engine": shared.url, "role": "decode"}) == 1
        assert count("pdgate_ttft_seconds_count", {"model": model, "mode": "disagg"
                     if model == "alpha" else "direct"}) == 1
    assert [r.body["model"] for r in shared.decodes] == ["alpha", "beta", "beta"]
    page = (await router.client.get("/dashboard/state")).json()
    assert sorted((e["model"], e["role"]) for e in page["engines"]) == [
        ("alpha", "decode"), ("alpha", "prefill"), ("beta", "decode")]
    assert page["models"] == {"alpha": "pull", "beta": "colocated"}


async def test_admin_changes_the_pool_of_the_model_it_names(
    make_engine: Callable[..., Awaitable[FakeEngine]], start_models: Start,
) -> None:
    admin = {"Authorization": "Bearer admin-secret-1"}
    router, (pa, da, db) = await two_models(make_engine, start_models,
                                            admin_api_key="admin-secret-1")
    c = router.client
    listed = (await c.get("/admin/engines", headers=admin)).json()["engines"]
    assert [(e["model"], e["url"], e["role"]) for e in listed] == [
        ("alpha", pa.url, "prefill"), ("alpha", da.url, "decode"), ("beta", db.url, "decode")]
    # beta's engine also serves alpha's decodes from now on (named by an alias).
    added = await c.post("/admin/engines", headers=admin,
                         json={"url": db.url, "role": "decode", "model": "alpha-alias"})
    assert added.status_code == 201 and added.json()["model"] == "alpha"
    unknown = await c.post("/admin/engines", headers=admin,
                           json={"url": db.url, "role": "decode", "model": "gamma"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    # Removed from alpha only: beta keeps serving on it, alpha goes back to its own D.
    gone = await c.delete(f"/admin/engines?url={db.url}&drain=false&model=alpha",
                          headers=admin)
    assert gone.status_code == 200 and gone.json()["models"] == ["alpha"]
    for _ in range(2):
        a = await c.post("/v1/completions", json={"model": "alpha", "prompt": "x",
                                                  "max_tokens": 2})
        assert a.headers["X-Pdgate-Decode-Engine"] == da.url
    b = await c.post("/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 3})
    assert b.status_code == 200 and b.json()["choices"][0]["text"] == "b1b2b3"
    # Without `model`, the engine leaves every pool it is in.
    await c.post("/admin/engines", headers=admin,
                 json={"url": db.url, "role": "decode", "model": "alpha"})
    gone = await c.delete(f"/admin/engines?url={db.url}&drain=false", headers=admin)
    assert sorted(gone.json()["models"]) == ["alpha", "beta"]
    assert (await c.post("/v1/completions", json={
        "model": "beta", "prompt": "x"})).status_code == 503
    again = await c.delete(f"/admin/engines?url={db.url}", headers=admin)
    assert again.status_code == 404 and again.json()["error"]["code"] == "engine_not_found"
