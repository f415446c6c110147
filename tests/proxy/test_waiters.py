"""WaiterTable semantics: both orders wake, deadlines, failures, caps, reaping, cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy import (
    KVReady,
    KVReadyTimeout,
    KVTransferFailed,
    ProxyMetrics,
    WaitCancelled,
    WaiterLimitExceeded,
    WaiterTable,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


REJECTED = "pdgate_proxy_notifications_rejected_total"


def ready(rid: str, status: str = "ok", error: str | None = None) -> KVReady:
    return KVReady(request_id=rid, engine_id="p0", num_tokens=8, status=status,  # type: ignore[arg-type]
                   error=error)


def value(m: ProxyMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def table(**kw: object) -> tuple[WaiterTable, ProxyMetrics, FakeClock]:
    m, clock = ProxyMetrics.create(), FakeClock()
    return WaiterTable(metrics=m, clock=clock, **kw), m, clock  # type: ignore[arg-type]


def deliver(t: WaiterTable, msg: KVReady) -> str:
    return t.notify(msg, received=time.perf_counter(), nbytes=100)


async def test_wait_before_notify_wakes_and_cleans_up() -> None:
    t, m, _ = table()
    t.register("a")
    task = asyncio.create_task(t.wait("a", timeout=5))
    await asyncio.sleep(0)
    assert deliver(t, ready("a")) == "delivered"
    assert (await task).request_id == "a"
    assert (t.waiter_count(), t.early_count()) == (0, 0)
    assert value(m, "pdgate_proxy_waits_total", outcome="ready") == 1
    assert value(m, "pdgate_proxy_wake_latency_seconds_count") == 1


async def test_notify_before_register_is_kept_and_claimed() -> None:
    t, m, _ = table()
    assert deliver(t, ready("a")) == "early"
    assert (t.early_count(), t.early_bytes()) == (1, 100)
    t.register("a")
    assert (await t.wait("a", timeout=5)).request_id == "a"
    assert (t.waiter_count(), t.early_count(), t.early_bytes()) == (0, 0, 0)
    assert value(m, "pdgate_proxy_early_notifications_total") == 1


async def test_notify_between_register_and_wait() -> None:
    t, _, _ = table()
    t.register("a")
    assert deliver(t, ready("a")) == "delivered"
    assert (await t.wait("a", timeout=5)).request_id == "a"
    assert t.waiter_count() == 0


async def test_wait_without_register_claims_early_arrival() -> None:
    t, _, _ = table()
    deliver(t, ready("a"))
    assert (await t.wait("a", timeout=5)).request_id == "a"
    assert t.early_count() == 0


async def test_deadline_raises_and_leaves_nothing() -> None:
    t, m, _ = table()
    t.register("a")
    with pytest.raises(KVReadyTimeout) as info:
        await t.wait("a", timeout=0.01)
    assert info.value.request_id == "a"
    assert (t.waiter_count(), t.early_count()) == (0, 0)
    assert value(m, "pdgate_proxy_waits_total", outcome="timeout") == 1


async def test_failed_status_wakes_with_error() -> None:
    t, m, _ = table()
    task = asyncio.create_task(t.wait("a", timeout=5))
    await asyncio.sleep(0)
    deliver(t, ready("a", status="failed", error="peer vanished"))
    with pytest.raises(KVTransferFailed) as info:
        await task
    assert (info.value.request_id, info.value.error) == ("a", "peer vanished")
    assert value(m, "pdgate_proxy_waits_total", outcome="failed") == 1
    assert t.waiter_count() == 0


async def test_second_notices_are_replays_and_first_wins() -> None:
    t, m, _ = table()
    assert deliver(t, ready("a")) == "early"
    assert deliver(t, ready("a", status="failed")) == "replay"
    t.register("b")
    assert deliver(t, ready("b")) == "delivered"
    assert deliver(t, ready("b")) == "replay"
    assert (await t.wait("a", timeout=1)).status == "ok"
    assert value(m, REJECTED, reason="replay") == 2


async def test_cancel_wakes_active_waiter_and_removes_entries() -> None:
    t, _, _ = table()
    task = asyncio.create_task(t.wait("a", timeout=5))
    await asyncio.sleep(0)
    assert t.cancel("a") is True
    with pytest.raises(WaitCancelled):
        await task
    t.register("b")
    deliver(t, ready("c"))
    assert t.cancel("b") and t.cancel("c") and not t.cancel("zzz")
    assert (t.waiter_count(), t.early_count(), t.early_bytes()) == (0, 0, 0)


async def test_task_cancellation_removes_waiter() -> None:
    t, _, _ = table()
    task = asyncio.create_task(t.wait("a", timeout=5))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert t.waiter_count() == 0
    assert deliver(t, ready("a")) == "unknown_waiter"  # late message: its waiter is gone
    assert t.early_count() == 0


async def test_second_concurrent_wait_is_refused() -> None:
    t, _, _ = table()
    task = asyncio.create_task(t.wait("a", timeout=5))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        await t.wait("a", timeout=5)
    deliver(t, ready("a"))
    await task


async def test_early_arrivals_bounded_by_count_oldest_first() -> None:
    t, m, _ = table(max_early=10)
    for i in range(25):
        deliver(t, ready(f"r{i}"))
    assert t.early_count() == 10
    assert value(m, "pdgate_proxy_evictions_total", reason="count") == 15
    assert (await t.wait("r24", timeout=1)).request_id == "r24"
    with pytest.raises(KVReadyTimeout):
        await t.wait("r0", timeout=0.001)


async def test_early_arrivals_bounded_by_bytes() -> None:
    t, m, _ = table(max_early_bytes=1000)
    for i in range(25):
        deliver(t, ready(f"r{i}"))
    assert (t.early_count(), t.early_bytes()) == (10, 1000)
    assert value(m, "pdgate_proxy_evictions_total", reason="bytes") == 15


async def test_waiter_limit_applies_backpressure() -> None:
    t, m, _ = table(max_waiters=2)
    t.register("a")
    t.register("b")
    t.register("a")  # idempotent
    with pytest.raises(WaiterLimitExceeded):
        t.register("c")
    assert value(m, "pdgate_proxy_waits_total", outcome="rejected") == 1


async def test_reap_drops_expired_entries_only() -> None:
    t, m, clock = table(ttl_s=10)
    deliver(t, ready("old-early"))
    t.register("old-waiter")
    active = asyncio.create_task(t.wait("old-active", timeout=60))
    await asyncio.sleep(0)
    clock.now += 11
    deliver(t, ready("young-early"))
    t.register("young-waiter")
    assert t.reap() == 2
    assert t.early_count() == 1 and t.waiter_count() == 2  # young-waiter + the active one
    assert value(m, "pdgate_proxy_reaped_total", what="early") == 1
    assert value(m, "pdgate_proxy_reaped_total", what="waiter") == 1
    deliver(t, ready("old-active"))
    assert (await active).request_id == "old-active"
    assert t.reap(clock.now + 100) == 2
    assert (t.waiter_count(), t.early_count(), t.early_bytes()) == (0, 0, 0)


def test_a_drained_flood_hands_memory_back_once() -> None:
    drained: list[int] = []
    t, _, clock = table(ttl_s=10, drained_min=3, on_drained=lambda: drained.append(1))
    for i in range(2):  # a small burst: nothing to hand back
        deliver(t, ready(f"small-{i}"))
    t.reap(clock.now + 11)
    assert drained == []
    for i in range(5):  # a flood
        deliver(t, ready(f"flood-{i}"))
    t.reap()  # still young: held
    assert drained == [] and t.early_count() == 5
    t.reap(clock.now + 11)
    assert drained == [1] and t.early_count() == 0
    t.reap(clock.now + 50)  # empty stays empty: no second call
    assert drained == [1]


async def test_size_gauges_read_the_table() -> None:
    t, m, _ = table()
    t.register("a")
    deliver(t, ready("b"))
    assert value(m, "pdgate_proxy_waiters") == 1
    assert value(m, "pdgate_proxy_early_arrivals") == 1
    assert value(m, "pdgate_proxy_early_arrival_bytes") == 100
