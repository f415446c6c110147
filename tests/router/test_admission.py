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


# ---- the fair queue: who is admitted next, on recorded arrivals ----

Arrival = tuple[str, int, str]  # (name, priority, flow)


async def admitted_order(arrivals: list[Arrival], order: str = "fair",
                         adm: Admission | None = None) -> list[str]:
    """Queue `arrivals` in this order behind one held slot, then free it: each admitted
    request notes its name and hands the slot on at once. The order of names is the
    order the queue chose (no timing: every request is queued before the first leaves)."""
    if adm is None:
        adm = Admission(max_concurrent=1, max_queued=len(arrivals), queue_timeout_s=60,
                        order=order)  # type: ignore[arg-type]
    held = await adm.acquire()
    admitted: list[str] = []

    async def one(name: str, priority: int, flow: str) -> None:
        slot = await adm.acquire(priority, flow)
        admitted.append(name)
        slot.release()

    tasks = []
    for name, priority, flow in arrivals:
        tasks.append(asyncio.create_task(one(name, priority, flow)))
        await asyncio.sleep(0)  # queued before the next arrives
    assert adm.queued == len(arrivals)
    held.release()
    await asyncio.gather(*tasks)
    assert (adm.active, adm.queued) == (0, 0)
    return admitted


FLOOD = [(f"f{i}", 0, "flood") for i in range(6)]


async def test_fifo_admits_in_arrival_order_whatever_the_key_and_priority() -> None:
    arrivals = [*FLOOD, ("i0", -5, "interactive"), ("i1", 0, "interactive")]
    assert await admitted_order(arrivals, "fifo") == [name for name, _, _ in arrivals]


async def test_fair_queue_lets_a_key_in_between_a_flooding_key() -> None:
    # Six from the flooding key, then two from another key at the same priority: the
    # second key waits behind one flood request each time, not behind all six.
    arrivals = [*FLOOD, ("i0", 0, "interactive"), ("i1", 0, "interactive")]
    assert await admitted_order(arrivals) == ["f0", "i0", "f1", "i1", "f2", "f3", "f4", "f5"]


async def test_a_lower_priority_gets_twice_the_slots_of_the_next() -> None:
    # Same key, priorities 0 and 1: start tags 0,1,2,.. against 0,2,4,.. (ties: arrival).
    arrivals = [*FLOOD, ("b0", 1, "flood"), ("b1", 1, "flood"), ("b2", 1, "flood")]
    assert await admitted_order(arrivals) == [
        "f0", "b0", "f1", "f2", "b1", "f3", "f4", "b2", "f5"]


async def test_a_high_priority_flow_gets_its_share_first_and_nobody_starves() -> None:
    # Priority -1 weighs 2 (tags 0, .5, 1, ...); priority 10, the lowest class, still gets
    # its first request in at its start tag, and its second only after 1024 steps of others.
    arrivals = [*FLOOD[:4], ("h0", -1, "k"), ("h1", -1, "k"), ("h2", -1, "k"),
                ("low0", 10, "k"), ("low1", 10, "k")]
    assert await admitted_order(arrivals) == [
        "f0", "h0", "low0", "h1", "f1", "h2", "f2", "f3", "low1"]


async def test_priorities_beyond_the_bound_weigh_as_the_bound() -> None:
    # 10 and 10**6 are one class (one flow of the key): arrival order between them.
    arrivals = [("a", 10**6, "k"), ("b", 10, "k"), ("c", 10**6, "k")]
    assert await admitted_order(arrivals) == ["a", "b", "c"]


async def test_a_cancelled_waiter_leaves_the_fair_order_intact() -> None:
    adm = Admission(max_concurrent=1, max_queued=10, queue_timeout_s=60)
    held = await adm.acquire()
    admitted: list[str] = []

    async def one(name: str, flow: str) -> None:
        slot = await adm.acquire(0, flow)
        admitted.append(name)
        slot.release()

    tasks = {}
    for name, flow in (("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b"), ("b1", "b")):
        tasks[name] = asyncio.create_task(one(name, flow))
        await asyncio.sleep(0)
    tasks["b0"].cancel()
    await asyncio.sleep(0)
    assert adm.queued == 4
    held.release()
    await asyncio.gather(*(t for n, t in tasks.items() if n != "b0"))
    assert admitted == ["a0", "a1", "b1", "a2"]  # b1 keeps the tag it arrived with
    assert (adm.active, adm.queued) == (0, 0)


async def test_an_emptied_queue_starts_every_flow_afresh() -> None:
    adm = Admission(max_concurrent=1, max_queued=10, queue_timeout_s=60)
    # A first busy period where the flood key queued far ahead of V...
    assert await admitted_order(FLOOD, adm=adm) == [n for n, _, _ in FLOOD]
    # ...is forgotten: in the next one its first request ties with anyone's first.
    arrivals = [*FLOOD[:3], ("i0", 0, "other")]
    assert await admitted_order(arrivals, adm=adm) == ["f0", "i0", "f1", "f2"]


async def test_check_room_refuses_before_any_work_only_when_full() -> None:
    adm = Admission(max_concurrent=1, max_queued=1, queue_timeout_s=60)
    adm.check_room()  # a free slot
    held = await adm.acquire()
    adm.check_room()  # room in the queue
    waiter = asyncio.create_task(adm.acquire())
    await eventually(lambda: adm.queued == 1, "queued")
    with pytest.raises(Overloaded) as info:
        adm.check_room()
    assert info.value.reason == "queue_full"
    held.release()
    (await waiter).release()


# ---- reserved slots: a flooding key never holds them all ----

async def test_reserved_slots_go_only_to_a_key_with_nothing_in_service() -> None:
    adm = Admission(max_concurrent=3, max_queued=10, queue_timeout_s=60, reserved=1)
    flood = [await adm.acquire(0, "flood"), await adm.acquire(0, "flood")]
    queued = asyncio.create_task(adm.acquire(0, "flood"))  # the last slot is reserved
    await eventually(lambda: adm.queued == 1, "the third flood request queued")
    light = await adm.acquire(0, "interactive")  # at once, beside the queued flood
    assert (adm.active, adm.queued) == (3, 1)
    light.release()  # its slot is the reserved one again: the flood still waits
    await asyncio.sleep(0)
    assert (adm.active, adm.queued, queued.done()) == (2, 1, False)
    light = await adm.acquire(0, "interactive")
    with pytest.raises(TimeoutError):  # a second one of the same key waits like anyone
        await asyncio.wait_for(adm.acquire(0, "interactive"), 0.05)
    light.release()
    flood.pop().release()  # two slots free: the queued flood request takes one
    (await queued).release()
    flood.pop().release()
    assert (adm.active, adm.queued) == (0, 0)


async def test_a_flood_alone_uses_all_but_the_reserved_slots() -> None:
    adm = Admission(max_concurrent=4, max_queued=0, queue_timeout_s=60, reserved=1)
    held = [await adm.acquire(0, "flood") for _ in range(3)]
    with pytest.raises(Overloaded):  # no queue: refused, though one slot is free
        await adm.acquire(0, "flood")
    adm.check_room()  # before parsing the key is unknown: the free slot counts
    held.append(await adm.acquire(0, "other"))
    for slot in held:
        slot.release()
    assert (adm.active, adm.queued) == (0, 0)
