"""Per-request KV-ready waiters, with early arrivals kept so no wake-up is ever lost.

The router calls `register(request_id)` *before* it dispatches the prefill leg, then
`await wait(request_id, timeout)`. The receive loop calls `notify(msg, ...)`. Whatever the
order in which these happen, the waiter sees the message once. A notification whose waiter
does not exist yet is an *early arrival*: it is kept (bounded by count and bytes, oldest
evicted first) until a waiter claims it or the reaper drops it after `ttl_s`. Waiters that
were registered but never awaited are reaped after `ttl_s` too.

Every operation is O(1) except `reap`, which is O(entries it drops). One table belongs to one
event loop; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import msgspec

from proxy.errors import KVReadyTimeout, KVTransferFailed, WaitCancelled, WaiterLimitExceeded
from proxy.metrics import ProxyMetrics
from proxy.wire import KVReady

NotifyResult = Literal["delivered", "early", "duplicate"]


class _Early(msgspec.Struct, gc=False):
    # gc=False: up to max_early of these live at once; keeping them out of the cyclic GC's
    # lists keeps full collections (and so wake-latency tails) short. No reference cycles.
    msg: KVReady
    at: float  # table clock, for the TTL
    received: float  # perf_counter at receipt
    nbytes: int


class _Waiter:
    __slots__ = ("future", "at", "waiting")

    def __init__(self, future: asyncio.Future[tuple[KVReady, float]], at: float) -> None:
        self.future = future  # result: (message, perf_counter at receipt)
        self.at = at
        self.waiting = False


class WaiterTable:
    """Waiters and early arrivals, keyed by request id.

    Args:
        ttl_s: lifetime (seconds) of an unclaimed early arrival and of a registered waiter
            nobody awaits. Active waits are bounded by their own deadline instead.
        max_waiters: `register` raises `WaiterLimitExceeded` beyond this many.
        max_early / max_early_bytes: caps on held early arrivals (count, payload bytes).
        metrics: where to count; a private registry when omitted.
        clock: monotonic clock in seconds for TTLs (injectable for tests).
        on_drained: called when the reaper has emptied a table that held at least
            `drained_min` early arrivals (the server returns the freed heap to the OS).
    """

    def __init__(
        self, *, ttl_s: float = 60.0, max_waiters: int = 100_000, max_early: int = 100_000,
        max_early_bytes: int = 64 << 20, metrics: ProxyMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_drained: Callable[[], None] | None = None, drained_min: int = 10_000,
    ) -> None:
        self._ttl = ttl_s
        self._on_drained = on_drained
        self._drained_min = drained_min
        self._early_peak = 0  # most early arrivals held since the table was last empty
        self._max_waiters = max_waiters
        self._max_early = max_early
        self._max_early_bytes = max_early_bytes
        self._clock = clock
        self._m = metrics if metrics is not None else ProxyMetrics.create()
        # Both maps are in insertion (= time) order, so the reaper stops at the first young
        # entry; OrderedDict because early arrivals are evicted from the front under floods.
        self._waiters: dict[str, _Waiter] = {}
        self._early: OrderedDict[str, _Early] = OrderedDict()
        self._early_bytes = 0
        self._m.watch_sizes(self.waiter_count, self.early_count, self.early_bytes)

    def waiter_count(self) -> int:
        """Registered waiters (awaited or not)."""
        return len(self._waiters)

    def early_count(self) -> int:
        """Held early arrivals."""
        return len(self._early)

    def early_bytes(self) -> int:
        """Payload bytes of held early arrivals."""
        return self._early_bytes

    def register(self, request_id: str) -> None:
        """Expect a notification for `request_id`; call before dispatching its prefill.

        Idempotent. Must run inside the event loop that will await. Raises
        `WaiterLimitExceeded` when `max_waiters` are registered.
        """
        if request_id not in self._waiters:
            self._new_waiter(request_id)

    def cancel(self, request_id: str) -> bool:
        """Forget the waiter (and any early arrival) of `request_id`; True if one existed.

        Called by the router when it abandons a request (e.g. its prefill failed). A task
        blocked in `wait` for it is woken with `WaitCancelled`.
        """
        w = self._waiters.pop(request_id, None)
        e = self._early.pop(request_id, None)
        if e is not None:
            self._early_bytes -= e.nbytes
        if w is not None and w.waiting and not w.future.done():
            w.future.set_exception(WaitCancelled(request_id))
        return w is not None or e is not None

    def notify(self, msg: KVReady, *, received: float, nbytes: int) -> NotifyResult:
        """Deliver `msg` (called by the receive loop; never blocks, never creates a task).

        `received` is `time.perf_counter()` at receipt (for the wake latency) and `nbytes`
        the payload size (for the early-arrival byte cap). A second message for a request
        whose first is still pending (delivered or early) is a duplicate and dropped.
        """
        rid = msg.request_id
        w = self._waiters.get(rid)
        if w is not None:
            if w.future.done():
                return "duplicate"
            w.future.set_result((msg, received))
            return "delivered"
        if rid in self._early:
            return "duplicate"
        self._early[rid] = _Early(msg, self._clock(), received, nbytes)
        self._early_bytes += nbytes
        self._m.early_arrivals_total.inc()
        self._evict()
        return "early"

    async def wait(self, request_id: str, timeout: float) -> KVReady:
        """Wait at most `timeout` seconds for the notification of `request_id`.

        Registers the waiter if `register` was not called (the caller then owns the race).
        Returns the `KVReady` with status ok; raises `KVTransferFailed` when the sender
        reported a failure, `KVReadyTimeout` at the deadline and `WaitCancelled` when
        `cancel` was called meanwhile. Whatever happens, the
        waiter is removed when this returns or raises. One concurrent wait per request id.
        """
        early = self._early.pop(request_id, None)
        if early is not None:
            self._early_bytes -= early.nbytes
            self._waiters.pop(request_id, None)
            return self._outcome(early.msg)
        w = self._waiters.get(request_id) or self._new_waiter(request_id)
        if w.waiting:
            raise RuntimeError(f"request {request_id!r} is already being waited for")
        w.waiting = True
        try:
            msg = await self._await(w, request_id, timeout)
        finally:
            if self._waiters.get(request_id) is w:
                del self._waiters[request_id]
        return self._outcome(msg)

    async def _await(self, w: _Waiter, request_id: str, timeout: float) -> KVReady:
        if w.future.done() and not w.future.cancelled():
            return w.future.result()[0]  # delivered before we got here: no suspension
        try:
            async with asyncio.timeout(timeout):
                msg, received = await w.future
        except TimeoutError:
            self._m.waits.labels("timeout").inc()
            raise KVReadyTimeout(request_id, timeout) from None
        except (asyncio.CancelledError, WaitCancelled):
            self._m.waits.labels("cancelled").inc()
            raise
        self._m.wake_latency.observe(time.perf_counter() - received)
        return msg

    def _outcome(self, msg: KVReady) -> KVReady:
        if msg.status == "failed":
            self._m.waits.labels("failed").inc()
            raise KVTransferFailed(msg.request_id, msg.engine_id, msg.error)
        self._m.waits.labels("ready").inc()
        return msg

    def _new_waiter(self, request_id: str) -> _Waiter:
        if len(self._waiters) >= self._max_waiters:
            self._m.waits.labels("rejected").inc()
            raise WaiterLimitExceeded(self._max_waiters)
        w = _Waiter(asyncio.get_running_loop().create_future(), self._clock())
        early = self._early.pop(request_id, None)
        if early is not None:  # claim it now, so its lifetime becomes the waiter's
            self._early_bytes -= early.nbytes
            w.future.set_result((early.msg, early.received))
        self._waiters[request_id] = w
        return w

    def _evict(self) -> None:
        while len(self._early) > self._max_early or self._early_bytes > self._max_early_bytes:
            reason = "count" if len(self._early) > self._max_early else "bytes"
            _, e = self._early.popitem(last=False)
            self._early_bytes -= e.nbytes
            self._m.evictions.labels(reason).inc()

    def reap(self, now: float | None = None) -> int:
        """Drop early arrivals and never-awaited waiters older than `ttl_s`; return how many.

        Called by `run_reaper` (or by tests with an explicit `now` on the table clock).
        """
        cutoff = (self._clock() if now is None else now) - self._ttl
        n_early = 0
        while self._early:
            e = self._early[next(iter(self._early))]
            if e.at > cutoff:
                break
            self._early.popitem(last=False)
            self._early_bytes -= e.nbytes
            n_early += 1
        stale = []
        for rid, w in self._waiters.items():
            if w.at > cutoff:
                break
            if not w.waiting:
                stale.append(rid)
        for rid in stale:
            self._waiters.pop(rid).future.cancel()
        self._shrink()
        if n_early:
            self._m.reaped.labels("early").inc(n_early)
        if stale:
            self._m.reaped.labels("waiter").inc(len(stale))
        return n_early + len(stale)

    def _shrink(self) -> None:
        # Python dicts never shrink on deletion; after a flood has drained, start fresh maps
        # so their (possibly large) hash tables go back to the allocator.
        self._early_peak = max(self._early_peak, len(self._early))
        if not self._early:
            self._early = OrderedDict()
            if self._early_peak >= self._drained_min and self._on_drained is not None:
                self._on_drained()
            self._early_peak = 0
        if not self._waiters:
            self._waiters = {}

    async def run_reaper(self, interval_s: float) -> None:
        """Call `reap` every `interval_s` seconds until cancelled (owned by the server)."""
        while True:
            await asyncio.sleep(interval_s)
            self.reap()
