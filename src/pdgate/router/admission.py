"""Admission control: at most N requests served at once, a bounded fair queue behind them.

A request takes a slot after its body was read and validated (a client trickling its
upload must not hold a slot, and its priority is in the body), so the queue holds at most
`max_queued` parsed requests: everything past that is refused at once with 429
(`Overloaded`). A queued request that waits past `queue_timeout_s` is refused the same way.
A finished request hands its slot straight to the next waiter (no thundering herd).

Which waiter is next (`order`):

- `fair` (default): start-time fair queuing over flows. A flow is one client key (its
  configured name; requests without a key share one flow) at one priority class; a
  request's priority (vLLM's meaning: an int, lower is served earlier, router/priority.py)
  gives its flow the weight `2 ** -p`, `p` bounded to [-10, 10] (`priority_class_of`).
  Each queued request gets a virtual start tag `max(V, F)` where `V` is the tag of the last
  request admitted and `F` the finish tag of its flow's previous request, which moves on by
  `1 / weight`; the smallest tag is admitted next (arrival order breaks ties). So two keys
  flooding at the same priority alternate, a key sending one request at a time waits behind
  at most one request of each other flow, a flow of priority `p - 1` gets twice the slots
  of one of priority `p`, and no flow starves.
- `fifo`: arrival order, priorities and keys ignored (the behaviour before fair queuing;
  bench/priority.py compares the two).

Used by `api.py` only, on the event loop (not thread-safe, by design: no locks needed).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable
from typing import Literal

from pdgate.router.errors import Overloaded

__all__ = ["PRIORITY_BOUND", "Admission", "AdmissionOrder", "Slot", "priority_class_of",
           "priority_label"]

AdmissionOrder = Literal["fair", "fifo"]
# Priorities beyond +-PRIORITY_BOUND weigh as the bound: the weights stay in 1/1024..1024
# and the flows of one key are at most 21.
PRIORITY_BOUND = 10


def priority_class_of(priority: int) -> int:
    """The priority class (flow) of `priority`: the priority bounded to +-PRIORITY_BOUND."""
    return max(-PRIORITY_BOUND, min(PRIORITY_BOUND, priority))


def priority_label(priority: int) -> str:
    """The metric label of a priority: `high` (< 0), `normal` (0) or `low` (> 0)."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


class Slot:
    """One admitted request's right to run. `release()` is idempotent; the request must call
    it however it ends (a streaming answer calls it when the stream is closed)."""

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Give the slot back (to the next waiter, if any)."""
        release, self._release = self._release, None
        if release is not None:
            release()


class _Waiter:
    __slots__ = ("fut", "tag")

    def __init__(self, fut: asyncio.Future[None], tag: float) -> None:
        self.fut = fut
        self.tag = tag


class Admission:
    """Counts requests in service and queues the overflow in `order`.

    `max_concurrent` > 0 slots; `max_queued` >= 0 waiters; `queue_timeout_s` > 0 seconds.
    `on_change(active, queued)` (optional) is called after every change, for gauges.
    `on_wait(outcome, seconds, priority)` (optional) is called once per request that got a
    slot or queued for one: outcome `admitted` (seconds 0 when a slot was free), `timeout`
    or `cancelled` (the client left while queued). A request refused because the queue was
    full never waited and is not reported.
    """

    def __init__(
        self,
        max_concurrent: int,
        max_queued: int,
        queue_timeout_s: float,
        on_change: Callable[[int, int], None] | None = None,
        on_wait: Callable[[str, float, int], None] | None = None,
        order: AdmissionOrder = "fair",
    ) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.order = order
        self.active = 0
        # (start tag, arrival number, waiter): the smallest is admitted next.
        self._heap: list[tuple[float, int, _Waiter]] = []
        self._arrivals = 0
        self._vtime = 0.0  # V: the start tag of the last request admitted from the queue
        self._finish: dict[tuple[str, int], float] = {}  # flow -> its last finish tag
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
        return len(self._heap)

    def check_room(self) -> None:
        """Raise `Overloaded` (queue_full) when `acquire` would refuse a request now: no
        free slot and no room to queue. Lets a caller refuse before working on a request."""
        if not self._free_slot() and len(self._heap) >= self.max_queued:
            raise Overloaded("the router is at capacity; retry later",
                             retry_after_s=self.retry_after_s)

    async def acquire(self, priority: int = 0, flow: str = "") -> Slot:
        """Take a slot, waiting in the queue if needed: `priority` (lower is earlier) and
        `flow` (the client key's name, "" without one) place the request in the fair
        order. Raises `Overloaded` when the queue is full or the wait passed
        `queue_timeout_s`."""
        if self._free_slot():
            self.active += 1
            self._changed()
            self._waited("admitted", 0.0, priority)
            return Slot(self._release)
        self.check_room()
        waiter = self._enqueue(priority, flow)
        queued_at = time.perf_counter()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter.fut
        except BaseException as exc:
            self._abandon(waiter)
            self._waited("timeout" if isinstance(exc, TimeoutError) else "cancelled",
                         time.perf_counter() - queued_at, priority)
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    f"no capacity within the queue timeout ({self.queue_timeout_s:g} s)",
                    retry_after_s=self.retry_after_s, reason="queue_timeout",
                ) from None
            raise
        self._waited("admitted", time.perf_counter() - queued_at, priority)
        return Slot(self._release)

    def _free_slot(self) -> bool:
        return self.active < self.max_concurrent and not self._heap

    def _enqueue(self, priority: int, flow: str) -> _Waiter:
        """Queue a waiter with its start tag (fifo: every request one flow of weight 1,
        so tags grow with arrivals)."""
        cls = priority_class_of(priority) if self.order == "fair" else 0
        key = (flow, cls) if self.order == "fair" else ("", 0)
        start = max(self._vtime, self._finish.get(key, self._vtime))
        self._finish[key] = start + 2.0 ** cls  # 1 / weight, weight = 2 ** -class
        waiter = _Waiter(asyncio.get_running_loop().create_future(), start)
        self._arrivals += 1
        heapq.heappush(self._heap, (start, self._arrivals, waiter))
        self._changed()
        return waiter

    def _abandon(self, waiter: _Waiter) -> None:
        # A waiter gave up (timeout or cancel). If the slot was handed over in the same
        # instant, pass it on; otherwise just leave the queue.
        if waiter.fut.done() and not waiter.fut.cancelled():
            self._release()
            return
        waiter.fut.cancel()
        for i, entry in enumerate(self._heap):
            if entry[2] is waiter:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                break
        self._drained()
        self._changed()

    def _release(self) -> None:
        now = time.monotonic()
        if self._last_release is not None:
            self._release_gap = 0.8 * self._release_gap + 0.2 * (now - self._last_release)
        self._last_release = now
        while self._heap:
            tag, _, waiter = heapq.heappop(self._heap)
            if not waiter.fut.done():
                self._vtime = max(self._vtime, tag)
                waiter.fut.set_result(None)  # the slot moves to this waiter; `active` unchanged
                self._drained()
                self._changed()
                return
        self.active -= 1
        self._changed()

    def _drained(self) -> None:
        # An empty queue ends the busy period: every flow starts again at V (the finish
        # tags of flows seen before are forgotten, so the table holds only live flows).
        if not self._heap:
            self._finish.clear()

    def _waited(self, outcome: str, seconds: float, priority: int) -> None:
        if self._on_wait is not None:
            self._on_wait(outcome, seconds, priority)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.active, len(self._heap))
