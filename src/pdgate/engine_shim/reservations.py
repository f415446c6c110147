"""D-side reservations of notify mode: KV blocks set aside for a prompt that P will WRITE.

The router asks D for a slot (`POST /v1/kv/reserve`) before it sends P the request; the
decode leg later `claim`s the blocks (now holding the prompt's KV) as its own. A reservation
nobody claims expires after `ttl` seconds; `release` (router abort) frees it after a short
grace. P never starts a WRITE after the router's deadline (`write_deadline`), and the TTL
outlasts that deadline, so no WRITE lands in blocks already given to another request.
Thread-safe; expiry runs from the engine's reaper task.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Reservation:
    """`reservation_id` is unique per reservation; `request_id` is the router's request id."""

    reservation_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float


class Reservations:
    """Reserved blocks by reservation id, in expiry order (one TTL for all)."""

    def __init__(self, ttl: float, free_blocks: Callable[[list[int]], None],
                 clock: Callable[[], float] = time.monotonic,
                 on_gone: Callable[[str], None] | None = None) -> None:
        if ttl <= 0:
            raise ValueError(f"reservation ttl must be > 0 seconds, got {ttl}")
        self._ttl = ttl
        self._free = free_blocks
        self._on_gone = on_gone  # told the id of every reservation freed unclaimed
        self._clock = clock
        self._items: OrderedDict[str, Reservation] = OrderedDict()
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self.expired_total = 0

    def add(self, request_id: str, block_ids: list[int], num_tokens: int) -> Reservation:
        """Hold `block_ids` (now owned by the table) for `request_id`."""
        with self._lock:
            rid = f"{request_id}@{next(self._seq)}"
            r = Reservation(rid, request_id, tuple(block_ids), num_tokens,
                            self._clock() + self._ttl)
            self._items[rid] = r
            return r

    def claim(self, reservation_id: str) -> Reservation | None:
        """Hand the blocks to the decode request (they are the caller's from now on)."""
        with self._lock:
            return self._items.pop(reservation_id, None)

    def release(self, request_id: str, grace: float = 0.0) -> int:
        """The router gave up on `request_id`: its reservations end `grace` seconds from now
        (a WRITE P posted just before its deadline may still be landing); returns how many
        reservations were cut short. With `grace=0` they are freed at once."""
        now = self._clock()
        with self._lock:
            ids = [k for k, v in self._items.items()
                   if v.request_id == request_id or k == request_id]
            for k in ids:
                r = self._items[k]
                self._items[k] = dataclasses.replace(
                    r, expires_at=min(r.expires_at, now + grace))
        if grace <= 0:
            self.expire()
        return len(ids)

    def expire(self) -> int:
        """Free reservations past their expiry; returns blocks freed. Scans every entry
        (`release` shortens expiries out of order; reservations in flight are few)."""
        now = self._clock()
        with self._lock:
            ids = [k for k, v in self._items.items() if v.expires_at <= now]
            gone = [self._items.pop(k) for k in ids]
            self.expired_total += len(gone)
        return self._free_all(gone)

    def release_all(self) -> int:
        with self._lock:
            gone = list(self._items.values())
            self._items.clear()
        return self._free_all(gone)

    def _free_all(self, gone: list[Reservation]) -> int:
        if self._on_gone is not None:
            for r in gone:
                self._on_gone(r.reservation_id)
        blocks = [b for r in gone for b in r.block_ids]
        if blocks:
            self._free(blocks)
        return len(blocks)

    @property
    def blocks(self) -> int:
        with self._lock:
            return sum(len(r.block_ids) for r in self._items.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
