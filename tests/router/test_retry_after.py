"""Retry-After on a 429 comes from the queue's real state: about a second while slots are
being freed (not the queue timeout, which made SDK clients sleep 30 s), longer when the
queue has not moved for a while."""

from __future__ import annotations

import asyncio

import pytest

from pdgate.router.admission import Admission
from pdgate.router.errors import Overloaded
from tests.router.conftest import MODEL
from tests.router.test_errors import MakeEngine, StartRouter
from tests.router.test_ops import eventually


async def fill(adm: Admission) -> list[asyncio.Task[object]]:
    waiters = [asyncio.create_task(adm.acquire()) for _ in range(adm.max_queued)]
    await eventually(lambda: adm.queued == adm.max_queued, "queue full")
    return waiters


async def test_a_moving_queue_says_about_a_second() -> None:
    adm = Admission(max_concurrent=2, max_queued=2, queue_timeout_s=30)
    for _ in range(20):  # slots freed quickly: the queue moves
        (await adm.acquire()).release()
    held = [await adm.acquire(), await adm.acquire()]
    waiters = await fill(adm)
    with pytest.raises(Overloaded) as info:
        await adm.acquire()
    assert info.value.reason == "queue_full" and info.value.retry_after_s == 1
    for slot in held:
        slot.release()
    for w in waiters:
        (await w).release()  # type: ignore[attr-defined]


async def test_a_stuck_queue_says_how_long_it_has_been_stuck() -> None:
    adm = Admission(max_concurrent=1, max_queued=1, queue_timeout_s=30)
    (await adm.acquire()).release()
    held = await adm.acquire()
    waiters = await fill(adm)
    adm._last_release -= 5.2  # type: ignore[operator]  # nothing freed for 5.2 s
    with pytest.raises(Overloaded) as info:
        await adm.acquire()
    assert info.value.retry_after_s == 6
    held.release()
    (await waiters[0]).release()  # type: ignore[attr-defined]


async def test_router_429_queue_full_retry_after_is_about_a_second(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(), await make_engine(delay_s=0.3)
    router = await start_router([p], [d], max_concurrent_requests=1, max_queued_requests=1,
                                queue_timeout_s=30)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for _ in range(2):  # the queue has moved before
        assert (await router.client.post("/v1/completions", json=body)).status_code == 200
    busy = [asyncio.create_task(router.client.post("/v1/completions", json=body))
            for _ in range(2)]
    await eventually(lambda: router.metric("pdgate_admission_queued") == 1, "queue full")
    resp = await router.client.post("/v1/completions", json=body)
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "overloaded"
    assert resp.headers["Retry-After"] == "1"  # was 30 (the queue timeout)
    assert all(r.status_code == 200 for r in await asyncio.gather(*busy))
