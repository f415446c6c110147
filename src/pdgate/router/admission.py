"""Admission control: at most N requests served at once, a bounded FIFO queue behind them.

A request takes a slot before its body is read, so memory is bounded by
`max_concurrent + max_queued` request bodies whatever the load: everything past that is
refused at once with 429 (`Overloaded`), cheaply, without reading the body. A queued request
that waits past `queue_timeout_s` is refused the same way. A finished request hands its slot
straight to the oldest waiter (no thundering herd, FIFO fairness).

Used by `api.py` only, on the event loop (not thread-safe, by design: no locks needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable

from pdgate.router.errors import Overloaded

__all__ = ["Admission", "Slot"]


class Slot:
    """One admitted request's right to run. `release()` is idempotent; the request must call
    it however it ends (a streaming answer calls it when the stream is closed)."""

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Give the slot back (to the oldest waiter, if any)."""
        release, self._release = self._release, None
        if release is not None:
            release()


class Admission:
    """Counts requests in service and queues the overflow.

    `max_concurrent` > 0 slots; `max_queued` >= 0 waiters; `queue_timeout_s` > 0 seconds.
    `on_change(active, queued)` (optional) is called after every change, for gauges.
    `on_wait(outcome, seconds)` (optional) is called once per request that got a slot or
    queued for one: outcome `admitted` (seconds 0 when a slot was free), `timeout` or
    `cancelled` (the client left while queued). A request refused because the queue was
    full never waited and is not reported.
    """

    def __init__(
        self,
        max_concurrent: int,
        max_queued: int,
        queue_timeout_s: float,
        on_change: Callable[[int, int], None] | None = None,
        on_wait: Callable[[str, float], None] | None = None,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._on_change = on_change
        self._on_wait = on_wait
        # When slots were last freed, and the smoothed gap between two: how soon a place
        # in the queue opens, what a refused client is told to wait (`retry_after_s`).
        self._last_release: float | None = None
        self._release_gap = 0.0

    @property
    def retry_after_s(self) -> int:
        """Seconds a refused client should wait (Retry-After), from the queue's real state:
        the time until a slot frees and the queue moves up one place, estimated from the
        recent gaps between freed slots (at least the time since the last one, so a stuck
        queue says so); a queue never seen moving says one queue timeout. 1 to 30."""
        if self._last_release is None:
            wait = self.queue_timeout_s
        else:
            wait = max(self._release_gap, time.monotonic() - self._last_release)
        return max(1, min(30, math.ceil(wait)))

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._waiters)

    async def acquire(self) -> Slot:
        """Take a slot, waiting in the queue if needed. Raises `Overloaded` when the queue is
        full or the wait passed `queue_timeout_s`."""
        if self.active < self.max_concurrent and not self._waiters:
            self.active += 1
            self._changed()
            self._waited("admitted", 0.0)
            return Slot(self._release)
        if len(self._waiters) >= self.max_queued:
            raise Overloaded("the router is at capacity; retry later",
                             retry_after_s=self.retry_after_s)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._changed()
        queued_at = time.perf_counter()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut
        except BaseException as exc:
            self._abandon(fut)
            self._waited("timeout" if isinstance(exc, TimeoutError) else "cancelled",
                         time.perf_counter() - queued_at)
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    f"no capacity within the queue timeout ({self.queue_timeout_s:g} s)",
                    retry_after_s=self.retry_after_s, reason="queue_timeout",
                ) from None
            raise
        self._waited("admitted", time.perf_counter() - queued_at)
        return Slot(self._release)

    def _abandon(self, fut: asyncio.Future[None]) -> None:
        # A waiter gave up (timeout or cancel). If the slot was handed over in the same
        # instant, pass it on; otherwise just leave the queue.
        if fut.done() and not fut.cancelled():
            self._release()
            return
        fut.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        self._changed()

    def _release(self) -> None:
        now = time.monotonic()
        if self._last_release is not None:
            self._release_gap = 0.8 * self._release_gap + 0.2 * (now - self._last_release)
        self._last_release = now
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to this waiter; `active` unchanged
                self._changed()
                return
        self.active -= 1
        self._changed()

    def _waited(self, outcome: str, seconds: float) -> None:
        if self._on_wait is not None:
            self._on_wait(outcome, seconds)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.active, len(self._waiters))
