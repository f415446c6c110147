"""Notify and push fail over like pull: a prefill or decode engine that fails before the
client's first byte is left out and the attempt runs again on other engines (with its own
engine-side id, after what the failed attempt held was released); with every prefill engine
down the request runs on a decode engine alone; the breakers hear about it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.router.conftest import MODEL, RunningRouter, sse_events, until
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
BODY = {"model": MODEL, "prompt": "Hello world", "max_tokens": 3}
MODES = ["notify", "push"]


def _text(resp_text: str, stream: bool) -> str:
    if not stream:
        import json

        return str(json.loads(resp_text)["choices"][0]["text"])
    return "".join(e["choices"][0]["text"] for e in sse_events(resp_text)
                   if isinstance(e, dict) and e.get("choices"))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", MODES)
async def test_failed_prefill_engine_is_retried_on_another(
    make_engine: MakeEngine, start_router: StartRouter, mode: str, stream: bool
) -> None:
    bad = await make_engine(engine_id="P0", fail_status=500)
    good = await make_engine(engine_id="P1")
    # Push: D waits for P's KV like a real engine would (the fake answers after a delay).
    d = await make_engine(engine_id="D0", delay_s=0.3 if mode == "push" else 0.0)
    router = await start_router([bad, good], [d], pd_mode=mode, prefill_policy="round-robin",
                                kv_ready_timeout_s=5.0, early_first_token=False)
    resp = await router.client.post("/v1/completions", json={**BODY, "stream": stream})
    assert resp.status_code == 200, resp.text
    assert _text(resp.text, stream) == "Hello world!"
    assert resp.headers["X-Pdgate-Prefill-Engine"] == good.url
    assert len(bad.prefills) == 1 and len(good.prefills) == 1
    assert router.metric("pdgate_retries_total", {"role": "prefill"}) == 1
    # The retry ran under its own engine-side id, and the failed attempt's state was freed.
    first = bad.prefills[0].headers["X-Request-Id"]
    assert good.prefills[0].headers["X-Request-Id"] == f"{first}-1"
    if mode == "notify":
        await until(lambda: first in d.aborts)  # D's reservation for the failed attempt


@pytest.mark.parametrize("mode", MODES)
async def test_unreachable_decode_engine_is_retried_on_another(
    make_engine: MakeEngine, start_router: StartRouter, mode: str
) -> None:
    p = await make_engine(engine_id="P0")
    dead, good = await make_engine(engine_id="D0"), await make_engine(engine_id="D1")
    router = await start_router([p], [dead, good], pd_mode=mode, decode_policy="round-robin",
                                kv_ready_timeout_s=5.0)
    await dead.stop()  # still marked healthy: health is probed hourly in these tests
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Pdgate-Decode-Engine"] == good.url
    assert router.metric("pdgate_retries_total", {"role": "decode"}) == 1
    ready = (await router.client.get("/ready")).json()
    assert ready["decode_healthy"] == 1  # the refused connection marked it down at once


@pytest.mark.parametrize("mode", MODES)
async def test_every_prefill_engine_down_runs_decode_only(
    make_engine: MakeEngine, start_router: StartRouter, mode: str
) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode=mode, kv_ready_timeout_s=5.0)
    await p.stop()
    for _ in range(2):  # the first finds P down; the second knows it already
        resp = await router.client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_prefill"}) == 2
    assert all(r.body.get("kv_transfer_params") is None for r in d.decodes)
    assert d.reserves == [] or mode == "notify"


@pytest.mark.parametrize("mode", MODES)
async def test_only_prefill_engine_dropping_the_connection_runs_decode_only(
    make_engine: MakeEngine, start_router: StartRouter, mode: str
) -> None:
    """P killed in the middle of a request's leg: the connection drops, and the pool still
    counts P healthy until its next probe (hourly here). The request runs on D alone,
    counted, as in the pull flow, instead of a 502 (seen in tests/chaos/test_migration.py's
    prefill kill, notify mode, once in a full suite)."""
    p = await make_engine(engine_id="P0", drop_completions=True)
    # Push: D waits for P's KV like a real engine would (the fake answers after a delay).
    d = await make_engine(engine_id="D0", delay_s=0.3 if mode == "push" else 0.0)
    router = await start_router([p], [d], pd_mode=mode, kv_ready_timeout_s=5.0)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    assert _text(resp.text, False) == "Hello world!"
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_prefill"}) == 1
    assert d.decodes[-1].body.get("kv_transfer_params") is None  # D computed the prompt
    # P was asked by the notify/push attempt only (twice: the engine client sends a
    # request again once when a reused connection closes before any byte), and D alone
    # followed without the pull flow asking P again (a host gone dark would cost another
    # connect timeout).
    modes = [r.body["kv_transfer_params"].get("pdgate_mode") for r in p.prefills]
    assert modes and set(modes) == {mode}, modes
    # The headers name the engines that served it: D alone, not the P that dropped it.
    assert "x-pdgate-prefill-engine" not in resp.headers, resp.headers
    assert resp.headers["x-pdgate-decode-engine"].startswith(d.url)


@pytest.mark.parametrize("mode", MODES)
async def test_only_prefill_engine_failing_is_a_clear_error_and_counted(
    make_engine: MakeEngine, start_router: StartRouter, mode: str
) -> None:
    p = await make_engine(engine_id="P0", fail_status=500)
    d = await make_engine(engine_id="D0")
    d.delay_s = 0.3 if mode == "push" else 0.0
    router = await start_router([p], [d], pd_mode=mode, kv_ready_timeout_s=5.0,
                                eject_consecutive_errors=2)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 502, resp.text
    assert "fake failure 500" in resp.json()["error"]["message"]
    # The second failure in a row opens P's breaker: with no prefill engine left, that
    # request (and the next) run on the decode engine alone instead of failing.
    for _ in range(2):
        resp = await router.client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
    assert router.metric("pdgate_breaker_opened_total", {"role": "prefill"}) == 1
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_prefill"}) == 2
