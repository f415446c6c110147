"""Admission control: a bounded number served at once, a bounded queue, 429 beyond it."""

from __future__ import annotations

import asyncio

import pytest

from pdgate.router.admission import Admission
from pdgate.router.errors import Overloaded
from tests.router.conftest import MODEL
from tests.router.test_errors import COMPLETIONS, MakeEngine, StartRouter
from tests.router.test_ops import eventually


async def test_slots_queue_fifo_and_refuse_when_full() -> None:
    adm = Admission(max_concurrent=1, max_queued=2, queue_timeout_s=60)
    first = await adm.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        slot = await adm.acquire()
        order.append(name)
        slot.release()

    waiters = [asyncio.create_task(wait("a")), asyncio.create_task(wait("b"))]
    await eventually(lambda: adm.queued == 2, "two requests queued")
    with pytest.raises(Overloaded) as info:
        await adm.acquire()
    assert info.value.status == 429 and info.value.reason == "queue_full"
    first.release()
    first.release()  # idempotent: must not free a second slot
    await asyncio.gather(*waiters)
    assert order == ["a", "b"]
    assert (adm.active, adm.queued) == (0, 0)


async def test_queue_timeout_refuses_and_leaves_the_queue() -> None:
    adm = Admission(max_concurrent=1, max_queued=5, queue_timeout_s=0.05)
    held = await adm.acquire()
    with pytest.raises(Overloaded) as info:
        await adm.acquire()
    assert info.value.reason == "queue_timeout"
    assert adm.queued == 0
    held.release()
    assert adm.active == 0


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    adm = Admission(max_concurrent=1, max_queued=5, queue_timeout_s=60)
    held = await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await eventually(lambda: adm.queued == 1, "queued")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    held.release()
    assert (adm.active, adm.queued) == (0, 0)
    (await adm.acquire()).release()


async def test_no_queue_refuses_at_once() -> None:
    adm = Admission(max_concurrent=2, max_queued=0, queue_timeout_s=1)
    a, b = await adm.acquire(), await adm.acquire()
    with pytest.raises(Overloaded):
        await adm.acquire()
    a.release()
    b.release()


async def test_router_answers_429_with_retry_after_over_capacity(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine(delay_s=10)
    router = await start_router([p], [d], max_concurrent_requests=1, max_queued_requests=0)
    body = {"model": MODEL, "prompt": "x"}
    slow = asyncio.create_task(router.client.post(COMPLETIONS, json=body))
    await eventually(lambda: router.metric("pdgate_admission_active") == 1, "slot taken")
    resp = await router.client.post(COMPLETIONS, json=body)
    assert resp.status_code == 429
    assert int(resp.headers["Retry-After"]) >= 1
    err = resp.json()["error"]
    assert err["type"] == "RateLimitError" and err["code"] == "overloaded"
    assert router.metric("pdgate_admission_rejected_total", {"reason": "queue_full"}) == 1
    d.delay_s = 0
    slow.cancel()  # the client goes away: its slot must come back
    await eventually(lambda: router.metric("pdgate_admission_active") == 0, "slot released")
    assert (await router.client.post(COMPLETIONS, json=body)).status_code == 200


async def test_streaming_request_holds_its_slot_until_the_stream_ends(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine()
    d = await make_engine(tokens=tuple(f"t{i}" for i in range(30)), token_delay_s=0.02)
    router = await start_router([p], [d], max_concurrent_requests=1, max_queued_requests=1,
                                queue_timeout_s=30)
    body = {"model": MODEL, "prompt": "x", "stream": True}
    first = asyncio.create_task(router.client.post(COMPLETIONS, json=body))
    await eventually(lambda: d.requests != [], "first stream started")
    second = asyncio.create_task(router.client.post(COMPLETIONS, json=body))
    await eventually(lambda: router.metric("pdgate_admission_queued") == 1, "second queued")
    # The second waits for the whole first stream, then gets the slot and completes.
    for resp in await asyncio.gather(first, second):
        assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
        assert "t29" in resp.text
    await eventually(lambda: router.metric("pdgate_admission_active") == 0, "all released")
