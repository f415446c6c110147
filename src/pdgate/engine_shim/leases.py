"""P-side leases: blocks pinned for a remote reader until it says "done" or time runs out.

Pure bookkeeping (no NIXL, no metrics): the connector decides what a released lease means.
Thread-safe, because leases are taken on the event loop (`hold_for_remote_decode`, `abort`)
and released on the agent thread (notifications, expiry).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    """`lease_id` is the `remote_request_id` the reader echoes back in its notification."""

    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # clock() seconds


class LeaseTable:
    """Leases by id, in expiry order (every lease gets the same `ttl`, so insertion order is
    expiry order and the reaper only looks at the front)."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        self._ttl = ttl
        self._clock = clock
        self._leases: OrderedDict[str, Lease] = OrderedDict()
        self._blocks = 0
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, request_id: str, block_ids: list[int]) -> Lease:
        """Pin `block_ids` for `request_id`. The lease id is the request id, made unique with
        a `#n` suffix when that request already holds a lease (a retried prefill)."""
        with self._lock:
            lease_id = request_id
            while lease_id in self._leases:
                lease_id = f"{request_id}#{next(self._seq)}"
            lease = Lease(lease_id, request_id, tuple(block_ids), self._clock() + self._ttl)
            self._leases[lease_id] = lease
            self._blocks += len(block_ids)
            return lease

    def pop(self, lease_id: str) -> Lease | None:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._blocks -= len(lease.block_ids)
            return lease

    def pop_request(self, request_id: str) -> list[Lease]:
        """Every lease of `request_id` (abort)."""
        with self._lock:
            ids = [k for k, v in self._leases.items() if v.request_id == request_id]
            return self._pop_ids(ids)

    def pop_expired(self) -> list[Lease]:
        now = self._clock()
        with self._lock:
            ids: list[str] = []
            for k, v in self._leases.items():
                if v.expires_at > now:
                    break
                ids.append(k)
            return self._pop_ids(ids)

    def pop_all(self) -> list[Lease]:
        with self._lock:
            return self._pop_ids(list(self._leases))

    def _pop_ids(self, ids: list[str]) -> list[Lease]:
        out = [self._leases.pop(k) for k in ids]
        self._blocks -= sum(len(x.block_ids) for x in out)
        return out

    @property
    def blocks(self) -> int:
        """Blocks pinned right now."""
        with self._lock:
            return self._blocks

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
