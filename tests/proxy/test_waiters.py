"""WaiterTable semantics: both orders wake, deadlines, failures, caps, reaping, cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdgate.proxy import (
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


# ---- notices bound to one request (tokens), accepted once ------------------------------

TOKEN = "9f" * 16  # what the router gets from secrets.token_hex(16)


def tokened(rid: str, token: str = TOKEN, status: str = "ok") -> KVReady:
    return KVReady(request_id=rid, engine_id="p0", status=status, token=token)  # type: ignore[arg-type]


async def test_forged_notices_do_not_touch_a_tokened_waiter() -> None:
    """A prefill engine signs whatever notice it is asked for: without the waiter's token, a
    `failed` for a healthy request (or an early `ok`) is dropped and the real one wakes it."""
    t, m, _ = table()
    t.register("a", token=TOKEN)
    task = asyncio.create_task(t.wait("a", timeout=5))
    await asyncio.sleep(0)
    assert deliver(t, tokened("a", token="guess", status="failed")) == "token_mismatch"
    assert deliver(t, ready("a", status="failed")) == "token_mismatch"  # v1 / no token
    lmcache = KVReady(request_id="a", engine_id="lmcache")  # what an LMCache notice becomes
    assert deliver(t, lmcache) == "token_mismatch"
    await asyncio.sleep(0)
    assert not task.done()
    assert deliver(t, tokened("a")) == "delivered"
    assert (await task).status == "ok"
    assert value(m, REJECTED, reason="token_mismatch") == 3
    assert value(m, "pdgate_proxy_waits_total", outcome="failed") == 0


async def test_a_replayed_notice_is_refused_during_and_after_the_wait() -> None:
    t, m, _ = table()
    t.register("a", token=TOKEN)
    assert deliver(t, tokened("a")) == "delivered"
    assert deliver(t, tokened("a", status="failed")) == "replay"  # captured and replayed
    assert (await t.wait("a", timeout=1)).status == "ok"
    assert deliver(t, tokened("a", status="failed")) == "replay"
    assert deliver(t, tokened("a", token="other")) == "replay"  # gone: token not kept
    assert (t.waiter_count(), t.early_count(), t.finished_count()) == (0, 0, 1)
    assert value(m, REJECTED, reason="replay") == 3
    assert value(m, "pdgate_proxy_finished_requests") == 1


async def test_notices_for_finished_waiters_are_dropped_not_held() -> None:
    t, m, _ = table()
    t.register("done")
    deliver(t, ready("done"))
    await t.wait("done", timeout=1)
    t.register("late")
    with pytest.raises(KVReadyTimeout):
        await t.wait("late", timeout=0.001)
    t.register("dropped")
    t.cancel("dropped")
    assert deliver(t, ready("done")) == "replay"
    assert deliver(t, ready("late")) == "unknown_waiter"
    assert deliver(t, ready("dropped")) == "unknown_waiter"
    assert t.early_count() == 0
    assert value(m, REJECTED, reason="unknown_waiter") == 2


async def test_a_reaped_waiter_is_remembered_too() -> None:
    t, _, clock = table(ttl_s=10)
    t.register("abandoned", token=TOKEN)
    clock.now += 11
    assert t.reap() == 1
    assert deliver(t, tokened("abandoned")) == "unknown_waiter"
    assert deliver(t, ready("abandoned")) == "unknown_waiter"
    assert t.early_count() == 0


async def test_tokened_notice_for_an_unregistered_id_is_dropped() -> None:
    t, m, _ = table()
    assert deliver(t, tokened("nobody")) == "unknown_waiter"
    assert t.early_count() == 0
    assert value(m, "pdgate_proxy_early_notifications_total") == 0


async def test_tokened_waiter_discards_an_untokened_early_arrival() -> None:
    t, m, _ = table()
    assert deliver(t, ready("a", status="failed")) == "early"  # e.g. forged before register
    t.register("a", token=TOKEN)
    assert (t.early_count(), t.early_bytes()) == (0, 0)
    assert value(m, REJECTED, reason="token_mismatch") == 1
    assert deliver(t, tokened("a")) == "delivered"
    assert (await t.wait("a", timeout=1)).status == "ok"


async def test_waiter_without_token_takes_any_notice() -> None:
    t, _, _ = table()
    t.register("a")
    assert deliver(t, tokened("a")) == "delivered"
    deliver(t, ready("b"))
    assert (await t.wait("a", timeout=1)).token == TOKEN
    assert (await t.wait("b", timeout=1)).token == ""


async def test_token_is_validated_and_cannot_change() -> None:
    t, _, _ = table()
    for bad in ("", "t" * 129):
        with pytest.raises(ValueError):
            t.register("a", token=bad)
    t.register("a", token=TOKEN)
    t.register("a", token=TOKEN)  # idempotent
    for other in ("other", None):
        with pytest.raises(ValueError):
            t.register("a", token=other)
    with pytest.raises(ValueError):
        await t.wait("a", timeout=1, token="other")
    assert t.waiter_count() == 1


async def test_wait_without_register_takes_the_token() -> None:
    t, _, _ = table()
    task = asyncio.create_task(t.wait("a", timeout=5, token=TOKEN))
    await asyncio.sleep(0)
    assert deliver(t, ready("a")) == "token_mismatch"
    assert deliver(t, tokened("a")) == "delivered"
    assert (await task).token == TOKEN


async def test_registering_a_finished_id_again_starts_afresh() -> None:
    t, _, _ = table()
    t.register("a", token=TOKEN)
    deliver(t, tokened("a"))
    await t.wait("a", timeout=1)
    t.register("a", token="fresh-token")
    assert t.finished_count() == 0
    assert deliver(t, tokened("a")) == "token_mismatch"  # the first request's notice
    assert deliver(t, tokened("a", token="fresh-token")) == "delivered"


async def test_finished_ids_are_forgotten_after_ttl_and_bounded() -> None:
    t, _, clock = table(ttl_s=10, max_waiters=3)
    for i in range(5):
        t.cancel(f"r{i}")
    assert t.finished_count() == 3  # the oldest two forgotten
    assert deliver(t, ready("r0")) == "early"
    assert deliver(t, ready("r4")) == "unknown_waiter"
    clock.now += 11
    t.reap()
    assert t.finished_count() == 0
    assert deliver(t, ready("r4")) == "early"


async def test_odd_tokens_off_the_wire_are_just_mismatches() -> None:
    t, _, _ = table()
    t.register("a", token=TOKEN)
    for odd in ("é" * 10, "\ud800", TOKEN[:-1], TOKEN + "0", TOKEN.upper()):
        assert deliver(t, tokened("a", token=odd)) == "token_mismatch"
    assert deliver(t, tokened("a")) == "delivered"


async def test_rejection_reasons_are_exported_from_the_start() -> None:
    _, m, _ = table()
    for reason in ("token_mismatch", "replay", "unknown_waiter"):
        assert m.registry.get_sample_value(REJECTED, {"reason": reason}) == 0
