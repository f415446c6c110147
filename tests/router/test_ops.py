"""Operational endpoints, health checking, in-flight release and client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine
from tests.router.test_pull_flow import PD

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]


async def eventually(check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    """Poll `check` until true; fail after 10 s (a bound on a hang, not a timing assert)."""
    for _ in range(1000):
        result = check()
        if await result if isinstance(result, Awaitable) else result:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_models_health_ready(pd: PD) -> None:
    p, d, router = pd
    models = (await router.client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [(MODEL, "model")]
    assert (await router.client.get("/health")).json() == {"status": "ok"}
    ready = await router.client.get("/ready")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "prefill_healthy": 1, "decode_healthy": 1}


async def test_metrics_exposition(pd: PD) -> None:
    p, d, router = pd
    await router.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    await router.client.post("/v1/completions",
                             json={"model": MODEL, "prompt": "hi", "stream": True})
    text = (await router.client.get("/metrics")).text
    for name in (
        'pdgate_requests_total{route="/v1/completions",status="200"} 2.0',
        "pdgate_request_duration_seconds_bucket",
        'pdgate_ttft_seconds_count{mode="disagg"} 1.0',  # the stream's: a whole answer has none
        "# TYPE pdgate_inter_token_latency_seconds histogram",
        "pdgate_prefill_duration_seconds_count 2.0",
        'pdgate_disagg_decisions_total{reason="disagg"} 2.0',
        f'pdgate_engine_healthy{{engine="{p.url}",role="prefill"}} 1.0',
        f'pdgate_engine_in_flight{{engine="{d.url}",role="decode"}} 0.0',
        "# TYPE pdgate_fallbacks_total counter",
        "# TYPE pdgate_retries_total counter",
    ):
        assert name in text, name


async def test_periodic_health_checks_mark_engines(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d], health_interval_s=0.05)

    async def ready_status() -> int:
        return (await router.client.get("/ready")).status_code

    d.health_status = 500
    await eventually(lambda: _is(ready_status(), 503), "decode marked unhealthy")
    resp = await router.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 503
    assert d.requests == []
    d.health_status = 200
    await eventually(lambda: _is(ready_status(), 200), "decode healthy again")
    resp = await router.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 200


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_client_disconnect_releases_upstream_and_in_flight(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine()
    d = await make_engine(tokens=tuple(f"t{i}" for i in range(500)), token_delay_s=0.02)
    router = await start_router([p], [d])
    labels = {"engine": d.url, "role": "decode"}
    body = {"model": MODEL, "prompt": "x", "stream": True}
    async with router.client.stream("POST", "/v1/completions", json=body) as resp:
        async for chunk in resp.aiter_raw():
            assert chunk.startswith(b"data: ")
            assert router.metric("pdgate_engine_in_flight", labels) == 1
            break
    await eventually(lambda: d.aborted_streams == 1, "decode stream aborted upstream")
    await eventually(lambda: router.metric("pdgate_engine_in_flight", labels) == 0,
                     "in-flight released")
    assert d.finished_streams == 0
    # The router still serves normally afterwards.
    d.tokens = ("ok",)
    d.token_delay_s = 0
    resp2 = await router.client.post("/v1/completions", json=body)
    assert resp2.status_code == 200 and "ok" in resp2.text
