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

Reserved slots (`reserved`, fair order only): the last `reserved` free slots go only to a
flow with no request in service. A flooding key then never holds every slot, so a key
sending one request at a time starts at once instead of waiting for a flood request to end
(a router cannot preempt a request it sent; vLLM's priority scheduling can, on the engine).
The price: a flow alone uses at most `max_concurrent - reserved` slots.

Used by `api.py` only, on the event loop (not thread-safe, by design: no locks needed).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
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


Flow = tuple[str, int]  # (client key name, priority class)


class Slot:
    """One admitted request's right to run. `release()` is idempotent; the request must call
    it however it ends (a streaming answer calls it when the stream is closed)."""

    __slots__ = ("_flow", "_release")

    def __init__(self, release: Callable[[Flow], None], flow: Flow) -> None:
        self._release: Callable[[Flow], None] | None = release
        self._flow = flow

    def release(self) -> None:
        """Give the slot back (to the next waiter, if any)."""
        release, self._release = self._release, None
        if release is not None:
            release(self._flow)


class _Waiter:
    __slots__ = ("arrival", "flow", "fut", "tag")

    def __init__(self, fut: asyncio.Future[None], tag: float, arrival: int,
                 flow: Flow) -> None:
        self.fut = fut
        self.tag = tag
        self.arrival = arrival
        self.flow = flow


class Admission:
    """Counts requests in service and queues the overflow in `order`.

    `max_concurrent` > 0 slots; `max_queued` >= 0 waiters; `queue_timeout_s` > 0 seconds;
    `reserved` (0 <= reserved < max_concurrent) slots kept for flows with nothing in
    service (module docstring). `on_change(active, queued)` (optional) is called after
    every change, for gauges. `on_wait(outcome, seconds, priority)` (optional) is called
    once per request that got a slot or queued for one: outcome `admitted` (seconds 0 when
    a slot was free), `timeout` or `cancelled` (the client left while queued). A request
    refused because the queue was full never waited and is not reported.
    """

    def __init__(
        self,
        max_concurrent: int,
        max_queued: int,
        queue_timeout_s: float,
        on_change: Callable[[int, int], None] | None = None,
        on_wait: Callable[[str, float, int], None] | None = None,
        order: AdmissionOrder = "fair",
        reserved: int = 0,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.order = order
        self.reserved = reserved if order == "fair" else 0
        self.active = 0
        # Per flow: its waiters in arrival order (their start tags only grow within a flow),
        # and its requests in service. The smallest head tag of a flow that may start is
        # admitted next (arrival order breaks ties). Invariant between calls: no queued
        # waiter may start (`_may_start`), so a free slot with a queue is a reserved one.
        self._queues: dict[Flow, deque[_Waiter]] = {}
        self._queued = 0
        self._in_service: dict[Flow, int] = {}
        self._arrivals = 0
        self._vtime = 0.0  # V: the start tag of the last request admitted from the queue
        self._finish: dict[Flow, float] = {}  # flow -> its last finish tag
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
        return self._queued

    def check_room(self, priority: int = 0, flow: str | None = None) -> None:
        """Raise `Overloaded` (queue_full) when `acquire` would refuse a request now: no
        slot it may take and no room to queue. Lets a caller refuse before working on a
        request (`flow` None: not known yet, any free slot counts)."""
        may = self.active < self.max_concurrent if flow is None else \
            self._may_start(self._flow(priority, flow))
        if not may and self._queued >= self.max_queued:
            raise self._full()

    def _full(self) -> Overloaded:
        return Overloaded("the router is at capacity; retry later",
                          retry_after_s=self.retry_after_s)

    async def acquire(self, priority: int = 0, flow: str = "") -> Slot:
        """Take a slot, waiting in the queue if needed: `priority` (lower is earlier) and
        `flow` (the client key's name, "" without one) place the request in the fair
        order. Raises `Overloaded` when the queue is full or the wait passed
        `queue_timeout_s`."""
        key = self._flow(priority, flow)
        if self._may_start(key):  # no queued waiter may (the invariant): not a queue jump
            self._start(key)
            self._changed()
            self._waited("admitted", 0.0, priority)
            return Slot(self._release, key)
        if self._queued >= self.max_queued:  # no slot it may take, and no room to queue
            raise self._full()
        waiter = self._enqueue(key)
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
        return Slot(self._release, key)

    def _flow(self, priority: int, flow: str) -> Flow:
        # fifo: every request is one flow of weight 1, so tags grow with arrivals.
        return (flow, priority_class_of(priority)) if self.order == "fair" else ("", 0)

    def _may_start(self, key: Flow) -> bool:
        free = self.max_concurrent - self.active
        return free > 0 and (free > self.reserved or not self._in_service.get(key))

    def _start(self, key: Flow) -> None:
        self.active += 1
        self._in_service[key] = self._in_service.get(key, 0) + 1

    def _enqueue(self, key: Flow) -> _Waiter:
        """Queue a waiter with its start tag."""
        start = max(self._vtime, self._finish.get(key, self._vtime))
        self._finish[key] = start + 2.0 ** key[1]  # 1 / weight, weight = 2 ** -class
        self._arrivals += 1
        waiter = _Waiter(asyncio.get_running_loop().create_future(), start, self._arrivals,
                         key)
        self._queues.setdefault(key, deque()).append(waiter)
        self._queued += 1
        self._changed()
        return waiter

    def _abandon(self, waiter: _Waiter) -> None:
        # A waiter gave up (timeout or cancel). If the slot was handed over in the same
        # instant, pass it on; otherwise just leave the queue.
        if waiter.fut.done() and not waiter.fut.cancelled():
            self._release(waiter.flow)
            return
        waiter.fut.cancel()
        queue = self._queues.get(waiter.flow)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._queued -= 1
            if not queue:
                del self._queues[waiter.flow]
        self._drained()
        self._changed()

    def _release(self, key: Flow) -> None:
        now = time.monotonic()
        if self._last_release is not None:
            self._release_gap = 0.8 * self._release_gap + 0.2 * (now - self._last_release)
        self._last_release = now
        self.active -= 1
        left = self._in_service[key] - 1
        if left:
            self._in_service[key] = left
        else:
            del self._in_service[key]
        waiter = self._next()
        if waiter is not None:  # the slot moves to it
            self._vtime = max(self._vtime, waiter.tag)
            self._start(waiter.flow)
            waiter.fut.set_result(None)
            self._drained()
        self._changed()

    def _next(self) -> _Waiter | None:
        """Take the queued waiter to admit now: the smallest start tag among the flows that
        may start; None when none may."""
        best: deque[_Waiter] | None = None
        for key, queue in list(self._queues.items()):
            while queue and queue[0].fut.done():  # cancelled, its `_abandon` not run yet
                queue.popleft()
                self._queued -= 1
            if not queue:
                del self._queues[key]
            elif self._may_start(key) and (best is None or (queue[0].tag, queue[0].arrival) <
                                         (best[0].tag, best[0].arrival)):
                best = queue
        if best is None:
            return None
        waiter = best.popleft()
        self._queued -= 1
        if not best:
            del self._queues[waiter.flow]
        return waiter

    def _drained(self) -> None:
        # An empty queue ends the busy period: every flow starts again at V (the finish
        # tags of flows seen before are forgotten, so the table holds only live flows).
        if not self._queued:
            self._finish.clear()

    def _waited(self, outcome: str, seconds: float, priority: int) -> None:
        if self._on_wait is not None:
            self._on_wait(outcome, seconds, priority)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.active, self._queued)
