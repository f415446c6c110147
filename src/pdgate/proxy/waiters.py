"""Per-request KV-ready waiters: each accepts exactly one notice, and only the one meant for it.

The router calls `register(request_id, token=...)` *before* it dispatches the prefill leg,
then `await wait(request_id, timeout)`. The receive loop calls `notify(msg, ...)`. Whatever
the order in which these happen, the waiter sees its notice once.

Bound to one request. A valid MAC only proves that some engine holding the secret sent the
notice, and anyone who can make a prefill engine prefill can have it sign a notice for any
request id. So the router registers each waiter with a fresh random token
(``secrets.token_hex(16)``), hands it to the prefill engine as ``notify_token`` in
kv_transfer_params, and the engine echoes it in ``KVReady.token`` inside the signed payload.
A waiter with a token takes only a notice carrying the same token (constant-time compare);
any other is dropped and counted (``token_mismatch``) and the waiter keeps waiting for the
real one, so a forged ``failed`` cannot fail a request nor a forged ``ok`` wake it early.
A waiter registered without a token takes any notice for its id (v1 and LMCache senders).

Accepted once. A waiter takes the first notice that matches; later ones for its id are
``replay``s. Once the waiter is gone (its wait returned or raised, or it was cancelled or
reaped) its request id is remembered for `ttl_s` (at most `max_waiters` ids, oldest
forgotten first): a late or replayed notice for it is dropped and counted (``replay`` if the
waiter had taken a notice, else ``unknown_waiter``), never held as an early arrival that a
later request reusing the id could claim. Registering the id again starts afresh.

Early arrivals: a notice for an id that has no waiter and is not remembered.
- Without a token (v1, LMCache, v2 with ``token=""``), it is held (bounded by count and
  bytes, oldest evicted first, dropped after `ttl_s`) until a waiter claims it: callers that
  register late, or only call `wait`, keep the old no-lost-wake-up guarantee. It can only
  satisfy a waiter registered without a token; a waiter with a token drops it when it
  registers (``token_mismatch``).
- With a token, it is dropped (``unknown_waiter``). The token came from a router that
  registered its waiter before dispatching the prefill, so a tokened notice with no waiter
  is late beyond memory, meant for an earlier process of the router, or forged: holding it
  could not help a real request, and would let junk evict untokened early arrivals. (A
  caller that passes a token to `wait` without `register` owns that race.)

Every operation is O(1) except `reap`, which is O(entries it drops). One table belongs to one
event loop; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import msgspec

from pdgate.proxy.errors import KVReadyTimeout, KVTransferFailed, WaitCancelled, WaiterLimitExceeded
from pdgate.proxy.metrics import ProxyMetrics, RejectReason
from pdgate.proxy.wire import MAX_TOKEN_LENGTH, KVReady

NotifyResult = Literal["delivered", "early", "token_mismatch", "replay", "unknown_waiter"]


class _Early(msgspec.Struct, gc=False):
    # gc=False: up to max_early of these live at once; keeping them out of the cyclic GC's
    # lists keeps full collections (and so wake-latency tails) short. No reference cycles.
    msg: KVReady
    at: float  # table clock, for the TTL
    received: float  # perf_counter at receipt
    nbytes: int


class _Gone(msgspec.Struct, gc=False):
    # A finished waiter's request id, remembered so late and replayed notices are refused.
    at: float  # table clock, for the TTL
    delivered: bool  # it took a notice: a later one is a replay


class _Waiter:
    __slots__ = ("future", "at", "waiting", "token", "accepted")

    def __init__(self, future: asyncio.Future[tuple[KVReady, float]], at: float,
                 token: bytes | None) -> None:
        self.future = future  # result: (message, perf_counter at receipt)
        self.at = at
        self.waiting = False
        self.token = token
        self.accepted = False

    def matches(self, msg: KVReady) -> bool:
        return self.token is None or hmac.compare_digest(self.token, _encode(msg.token))

    def accept(self, msg: KVReady, received: float) -> None:
        self.accepted = True
        self.future.set_result((msg, received))


def _encode(token: str) -> bytes:
    # compare_digest takes ASCII-only str; a token off the wire can be any str (even a lone
    # surrogate from a JSON escape), so compare bytes.
    return token.encode("utf-8", "surrogatepass")


def _check_token(token: str | None) -> bytes | None:
    if token is None:
        return None
    if not 0 < len(token) <= MAX_TOKEN_LENGTH:
        raise ValueError(f"token: 1 to {MAX_TOKEN_LENGTH} characters, got {len(token)}")
    return _encode(token)


class WaiterTable:
    """Waiters, early arrivals and recently finished request ids, keyed by request id.

    Args:
        ttl_s: lifetime (seconds) of an unclaimed early arrival, of a registered waiter
            nobody awaits, and of the memory of a finished waiter. Active waits are bounded
            by their own deadline instead.
        max_waiters: `register` raises `WaiterLimitExceeded` beyond this many; also the most
            finished request ids remembered (the oldest are forgotten first).
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
        # All maps are in insertion (= time) order, so the reaper stops at the first young
        # entry; OrderedDict where floods evict from the front.
        self._waiters: dict[str, _Waiter] = {}
        self._early: OrderedDict[str, _Early] = OrderedDict()
        self._early_bytes = 0
        self._gone: OrderedDict[str, _Gone] = OrderedDict()
        self._m.watch_sizes(self.waiter_count, self.early_count, self.early_bytes,
                            finished=self.finished_count)

    def waiter_count(self) -> int:
        """Registered waiters (awaited or not)."""
        return len(self._waiters)

    def early_count(self) -> int:
        """Held early arrivals."""
        return len(self._early)

    def early_bytes(self) -> int:
        """Payload bytes of held early arrivals."""
        return self._early_bytes

    def finished_count(self) -> int:
        """Request ids of finished waiters remembered (to refuse late and replayed notices)."""
        return len(self._gone)

    def register(self, request_id: str, token: str | None = None) -> None:
        """Expect a notification for `request_id`; call before dispatching its prefill.

        With `token` (1 to 128 characters; the router uses ``secrets.token_hex(16)`` and sends
        it to the prefill engine as ``notify_token``), only a notice whose ``token`` equals it
        is accepted. Idempotent for the same token; raises ValueError for a bad token or one
        that differs from the waiter's. Must run inside the event loop that will await.
        Raises `WaiterLimitExceeded` when `max_waiters` are registered.
        """
        want = _check_token(token)
        w = self._waiters.get(request_id)
        if w is None:
            self._new_waiter(request_id, want)
        elif w.token != want:
            raise ValueError(f"request {request_id!r} is registered with another token")

    def cancel(self, request_id: str) -> bool:
        """Forget the waiter (and any early arrival) of `request_id`; True if one existed.

        Called by the router when it abandons a request (e.g. its prefill failed). A task
        blocked in `wait` for it is woken with `WaitCancelled`. Notices for the id that come
        later are refused until it is registered again.
        """
        w = self._waiters.pop(request_id, None)
        e = self._early.pop(request_id, None)
        if e is not None:
            self._early_bytes -= e.nbytes
        if w is not None and w.waiting and not w.future.done():
            w.future.set_exception(WaitCancelled(request_id))
        self._remember(request_id, w is not None and w.accepted)
        return w is not None or e is not None

    def notify(self, msg: KVReady, *, received: float, nbytes: int) -> NotifyResult:
        """Deliver `msg` (called by the receive loop; never blocks, never creates a task).

        `received` is `time.perf_counter()` at receipt (for the wake latency) and `nbytes`
        the payload size (for the early-arrival byte cap). Returns ``delivered`` or
        ``early``, or why the notice was dropped (counted in
        ``notifications_rejected_total{reason}``): ``token_mismatch``, ``replay`` (its
        waiter already took one) or ``unknown_waiter`` (no waiter will ever take it).
        """
        rid = msg.request_id
        w = self._waiters.get(rid)
        if w is not None:
            return self._offer(w, msg, received)
        gone = self._gone.get(rid)
        if gone is not None:
            return self._reject("replay" if gone.delivered else "unknown_waiter")
        if msg.token:  # registered before dispatch, so none is coming: see the module doc
            return self._reject("unknown_waiter")
        if rid in self._early:
            return self._reject("replay")
        self._early[rid] = _Early(msg, self._clock(), received, nbytes)
        self._early_bytes += nbytes
        self._m.early_arrivals_total.inc()
        self._evict()
        return "early"

    async def wait(self, request_id: str, timeout: float, *,
                   token: str | None = None) -> KVReady:
        """Wait at most `timeout` seconds for the notification of `request_id`.

        Registers the waiter (with `token`) if `register` was not called: the caller then
        owns the race with the sender. Returns the `KVReady` with status ok; raises
        `KVTransferFailed` when the sender reported a failure, `KVReadyTimeout` at the
        deadline and `WaitCancelled` when `cancel` was called meanwhile. Whatever happens,
        the waiter is removed when this returns or raises. One concurrent wait per request
        id; a `token` that differs from the registered one raises ValueError.
        """
        w = self._waiters.get(request_id)
        if w is None:
            w = self._new_waiter(request_id, _check_token(token))
        elif token is not None and w.token != _check_token(token):
            raise ValueError(f"request {request_id!r} is registered with another token")
        if w.waiting:
            raise RuntimeError(f"request {request_id!r} is already being waited for")
        w.waiting = True
        try:
            msg = await self._await(w, request_id, timeout)
        finally:
            if self._waiters.get(request_id) is w:
                del self._waiters[request_id]
                self._remember(request_id, w.accepted)
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

    def _offer(self, w: _Waiter, msg: KVReady, received: float) -> NotifyResult:
        if not w.matches(msg):
            return self._reject("token_mismatch")
        if w.accepted:
            return self._reject("replay")
        if w.future.done():  # its wait timed out or was cancelled and is unwinding
            return self._reject("unknown_waiter")
        w.accept(msg, received)
        return "delivered"

    def _reject(self, reason: RejectReason) -> NotifyResult:
        self._m.reject(reason)
        return reason

    def _new_waiter(self, request_id: str, token: bytes | None) -> _Waiter:
        if len(self._waiters) >= self._max_waiters:
            self._m.waits.labels("rejected").inc()
            raise WaiterLimitExceeded(self._max_waiters)
        w = _Waiter(asyncio.get_running_loop().create_future(), self._clock(), token)
        self._gone.pop(request_id, None)  # the id is in use again
        early = self._early.pop(request_id, None)
        if early is not None:  # claim it now, so its lifetime becomes the waiter's
            self._early_bytes -= early.nbytes
            if w.matches(early.msg):
                w.accept(early.msg, early.received)
            else:
                self._m.reject("token_mismatch")
        self._waiters[request_id] = w
        return w

    def _remember(self, request_id: str, delivered: bool) -> None:
        old = self._gone.pop(request_id, None)  # re-inserted at the end: young again
        self._gone[request_id] = _Gone(self._clock(), delivered or bool(old and old.delivered))
        if len(self._gone) > self._max_waiters:
            self._gone.popitem(last=False)

    def _evict(self) -> None:
        while len(self._early) > self._max_early or self._early_bytes > self._max_early_bytes:
            reason = "count" if len(self._early) > self._max_early else "bytes"
            _, e = self._early.popitem(last=False)
            self._early_bytes -= e.nbytes
            self._m.evictions.labels(reason).inc()

    def reap(self, now: float | None = None) -> int:
        """Drop early arrivals and never-awaited waiters older than `ttl_s`; return how many.

        Finished request ids older than `ttl_s` are forgotten too (not counted). Called by
        `run_reaper` (or by tests with an explicit `now` on the table clock).
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
        while self._gone and self._gone[next(iter(self._gone))].at <= cutoff:
            self._gone.popitem(last=False)
        stale = self._stale_waiters(cutoff)
        self._shrink()
        if n_early:
            self._m.reaped.labels("early").inc(n_early)
        if stale:
            self._m.reaped.labels("waiter").inc(stale)
        return n_early + stale

    def _stale_waiters(self, cutoff: float) -> int:
        # Runs after the old finished ids were forgotten: these are remembered for a full
        # ttl_s from now, like any other finished waiter.
        stale = []
        for rid, w in self._waiters.items():
            if w.at > cutoff:
                break
            if not w.waiting:
                stale.append(rid)
        for rid in stale:
            w = self._waiters.pop(rid)
            w.future.cancel()
            self._remember(rid, w.accepted)
        return len(stale)

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
        if not self._gone:
            self._gone = OrderedDict()

    async def run_reaper(self, interval_s: float) -> None:
        """Call `reap` every `interval_s` seconds until cancelled (owned by the server)."""
        while True:
            await asyncio.sleep(interval_s)
            self.reap()
