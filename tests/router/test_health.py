"""Engine health (thresholds, circuit breaker), failover, cancellation and KV aborts."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdgate.router.health import BreakerState, EngineHealth, HealthSettings, backoff_s
from tests.router.conftest import MODEL
from tests.router.fake_engine import DECODE_PROMPT_TOKENS
from tests.router.test_errors import COMPLETIONS, MakeEngine, StartRouter
from tests.router.test_ops import eventually

BODY = {"model": MODEL, "prompt": "x"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_probe_verdicts_need_consecutive_results() -> None:
    h = EngineHealth(HealthSettings(failure_threshold=2, success_threshold=2))
    assert h.probe(False, True) is False  # the first check decides at once
    assert h.probe(True, False) is False
    assert h.probe(True, False) is True
    assert h.probe(False, True) is True  # one flaky probe is tolerated
    assert h.probe(True, True) is True
    assert h.probe(False, True) is True
    assert h.probe(False, True) is False


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = Clock()
    opened: list[int] = []
    h = EngineHealth(HealthSettings(eject_after=3, open_s=10), clock=clock,
                     on_open=lambda: opened.append(1))
    h.record_failure()
    h.record_failure()
    h.record_success()  # the run of errors is broken
    for _ in range(2):
        h.record_failure()
    assert h.state is BreakerState.CLOSED and h.admits(in_flight=5)
    h.record_failure()
    assert h.state is BreakerState.OPEN and not h.admits(in_flight=0)
    clock.now += 10
    assert h.state is BreakerState.HALF_OPEN
    assert h.admits(in_flight=0) and not h.admits(in_flight=1)  # one trial at a time
    h.record_failure()  # the trial failed: open again for another period
    assert h.state is BreakerState.OPEN
    clock.now += 10
    h.record_success()
    assert h.state is BreakerState.CLOSED and h.consecutive_errors == 0
    assert len(opened) == 2


def test_backoff_is_exponential_capped_and_jittered() -> None:
    assert backoff_s(1, 0.0) == 0.0
    assert backoff_s(1, 0.1, rand=lambda: 0.0) == 0.05
    assert backoff_s(1, 0.1, rand=lambda: 1.0) == 0.1
    assert backoff_s(3, 0.1, rand=lambda: 1.0) == 0.4
    assert backoff_s(10, 0.1, cap_s=1.0, rand=lambda: 1.0) == 1.0


async def test_failing_engine_is_ejected_then_given_a_trial(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p0, p1, d = await make_engine(fail_status=500), await make_engine(), await make_engine()
    router = await start_router([p0, p1], [d], prefill_policy="round-robin",
                                eject_consecutive_errors=2, breaker_open_s=3600,
                                admin_api_key="admin-secret-1")
    for _ in range(6):
        assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200
    assert len(p0.requests) == 2  # ejected after two failures in a row
    assert router.metric("pdgate_breaker_opened_total", {"role": "prefill"}) == 1
    engines = (await router.client.get(
        "/admin/engines", headers={"Authorization": "Bearer admin-secret-1"})).json()["engines"]
    assert engines[0]["breaker"] == "open" and engines[1]["breaker"] == "closed"


async def test_ready_reflects_breakers_and_models_works_with_engines_down(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine(fail_status=503)
    router = await start_router([p], [d], eject_consecutive_errors=1, breaker_open_s=3600,
                                max_retries=0)
    assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 502
    assert (await router.client.get("/ready")).status_code == 503  # no healthy pair
    await p.stop()
    await d.stop()
    models = await router.client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


async def test_prefill_timeout_is_retried_on_another_prefill_engine(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    slow, fast = await make_engine(delay_s=30, kv_endpoints=True), await make_engine()
    d = await make_engine()
    router = await start_router([slow, fast], [d], prefill_policy="round-robin",
                                prefill_timeout_s=0.3)
    resp = await router.client.post(COMPLETIONS, json=BODY)
    assert resp.status_code == 200
    assert resp.headers["X-Pdgate-Prefill-Engine"] == fast.url
    rid = resp.headers["X-Request-Id"]
    await eventually(lambda: slow.aborts == [rid], "the stalled P told to free the request")


async def test_failed_decode_leg_frees_prefill_blocks(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(kv_endpoints=True), await make_engine(fail_status=500)
    router = await start_router([p], [d])
    resp = await router.client.post(COMPLETIONS, json=BODY)
    assert resp.status_code == 502
    await eventually(lambda: p.aborts == [resp.headers["X-Request-Id"]], "abort sent to P")
    await eventually(lambda: router.metric("pdgate_kv_aborts_total", {"result": "ok"}) == 1,
                     "abort counted")


async def test_kv_abort_unsupported_by_engine_is_ignored(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine(kv_endpoints=False)  # no /v1/kv/abort, like vLLM
    d = await make_engine(fail_status=500)
    router = await start_router([p], [d])
    assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 502
    await eventually(
        lambda: router.metric("pdgate_kv_aborts_total", {"result": "unsupported"}) == 1,
        "404 counted as unsupported")
    assert (await router.client.get("/health")).status_code == 200


async def test_client_disconnect_cancels_a_non_streaming_request(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(kv_endpoints=True), await make_engine(delay_s=30)
    router = await start_router([p], [d])
    labels = {"engine": d.url, "role": "decode"}
    rid = "disconnect-me"
    async with httpx.AsyncClient(base_url=router.url) as client:
        call = asyncio.create_task(
            client.post(COMPLETIONS, json=BODY, headers={"X-Request-Id": rid}))
        await eventually(lambda: router.metric("pdgate_engine_in_flight", labels) == 1,
                         "decode leg running")
        call.cancel()  # the client goes away mid-request
    await eventually(lambda: router.metric("pdgate_engine_in_flight", labels) == 0,
                     "decode leg cancelled")
    internal = p.prefills[0].headers["X-Request-Id"]
    assert internal != rid  # engines key requests by the router's own id
    await eventually(lambda: p.aborts == [internal], "P told to free the request's blocks")
    await eventually(
        lambda: router.metric("pdgate_requests_total",
                              {"route": COMPLETIONS, "status": "499"}) == 1,
        "counted as closed by the client")


async def test_decode_retry_after_d_was_reached_recomputes_instead_of_rereading_kv(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d0, d1 = await make_engine(), await make_engine(fail_status=500), await make_engine()
    router = await start_router([p], [d0, d1], decode_policy="round-robin")
    resp = await router.client.post(COMPLETIONS, json=BODY)
    assert resp.status_code == 200
    # D0 got P's params and may have read (and released) P's blocks: D1 must not read them.
    assert d0.decodes[0].body["kv_transfer_params"] == p.kv_params(p.prefills[0])
    assert "kv_transfer_params" not in d1.decodes[0].body
    assert resp.json()["usage"]["prompt_tokens"] == DECODE_PROMPT_TOKENS  # D's own count
    assert router.metric("pdgate_fallbacks_total", {"reason": "decode_retry"}) == 1
    await eventually(lambda: p.aborts == [resp.headers["X-Request-Id"]], "P frees its blocks")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_only_decode_engine_recomputes_when_the_kv_load_fails(
    make_engine: MakeEngine, start_router: StartRouter, stream: bool
) -> None:
    """P died after its reply, before the only D read the KV: D fails the decode (vLLM's
    500); with no other D the retry runs on the same D without params (D recomputes)."""
    p, d = await make_engine(), await make_engine(fail_kv_loads=True)
    router = await start_router([p], [d])
    resp = await router.client.post(COMPLETIONS, json={**BODY, "stream": stream})
    assert resp.status_code == 200
    if stream:
        assert '" world"' in resp.text and "error" not in resp.text
    else:
        assert resp.json()["choices"][0]["text"] == "Hello world!"
    assert "kv_transfer_params" in d.decodes[0].body
    assert "kv_transfer_params" not in d.decodes[1].body
    assert len(d.decodes) == 2  # one extra attempt, not more
    assert router.metric("pdgate_fallbacks_total", {"reason": "decode_retry"}) == 1


async def test_only_decode_engine_gets_one_retry_on_itself_for_a_changed_body_only(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    """A D that fails every decode: one retry without the KV params, then a 502; a plain
    (decode-only) request gets no second try on the same D."""
    p, d = await make_engine(), await make_engine(fail_status=500)
    router = await start_router([p], [d], max_retries=3, eject_consecutive_errors=100)
    assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 502
    assert len(d.decodes) == 2
    direct = await start_router([p], [d], disagg_min_tokens=10_000,
                                eject_consecutive_errors=100)
    assert (await direct.client.post(COMPLETIONS, json=BODY)).status_code == 502
    assert len(d.decodes) == 3
    # Two Ds: the recompute body already ran (and failed) on D1, so neither gets another try.
    d1 = await make_engine(fail_status=500)
    two = await start_router([p], [d, d1], max_retries=3, eject_consecutive_errors=100)
    assert (await two.client.post(COMPLETIONS, json=BODY)).status_code == 502
    assert len(d.decodes) + len(d1.decodes) == 5
