"""Errors raised by the KV-ready proxy to its callers (the router's flows, the sender)."""

from __future__ import annotations


class ProxyError(Exception):
    """Base of every error the proxy raises to a caller."""


class KVReadyTimeout(ProxyError):
    """No KV-ready notification for `request_id` arrived before the wait's deadline.

    The waiter is gone when this is raised; a notification that arrives later is kept as an
    early arrival until the reaper drops it.
    """

    def __init__(self, request_id: str, timeout_s: float) -> None:
        super().__init__(f"no KV-ready notification for {request_id!r} within {timeout_s:g}s")
        self.request_id = request_id
        self.timeout_s = timeout_s


class KVTransferFailed(ProxyError):
    """The prefill engine reported that the KV transfer for `request_id` failed."""

    def __init__(self, request_id: str, engine_id: str, error: str | None) -> None:
        super().__init__(
            f"KV transfer for {request_id!r} failed on engine {engine_id!r}: {error or 'unknown'}"
        )
        self.request_id = request_id
        self.engine_id = engine_id
        self.error = error


class WaiterLimitExceeded(ProxyError):
    """`register` refused a new waiter because `max_waiters` are already registered.

    Waiters are created by our own router, so the table applies backpressure here instead of
    evicting a request that is still in flight.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(f"too many KV-ready waiters registered (limit {limit})")
        self.limit = limit


class WaitCancelled(ProxyError):
    """`cancel(request_id)` was called while a task was waiting for `request_id`."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"wait for {request_id!r} was cancelled")
        self.request_id = request_id
