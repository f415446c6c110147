"""Per-key token quotas: prompt plus completion tokens over a sliding 60-second window.

A key with `tokens_per_minute` (router/config.py `ClientKey`) may start a request while the
tokens its requests used in the last 60 s are fewer than its quota; otherwise the request
is refused at once with 429 `rate_limit_exceeded` and a `Retry-After` of the seconds until
enough of those tokens leave the window to bring it under the quota again (exact to the
second: the window holds each request's tokens with the time it ended).

Tokens are what the engines' usage blocks said, as the router relayed them to the client
(`RequestRecord.prompt_tokens` / `completion_tokens`, counted by `RouterMetrics.observe_usage`:
the final usage of a non-streaming answer, the last usage chunk of a stream, which the
router always asks the decode engine for). They are charged when the request ends, so a
request that starts under the quota runs to its end and may take the key over it; the
next requests then wait. A request that failed before any usage was relayed costs nothing.

Sliding, not fixed, window: a fixed minute lets a key spend twice its quota across a
minute boundary; the sliding window never lets the last 60 s hold more than the quota
plus the requests already running when it was reached.

Per process: each router process (each `--workers` worker, each replica) counts alone, so
a key whose requests spread over N processes may use up to N times its quota.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from pdgate.router.errors import QuotaExceeded
from pdgate.router.priority import KeySettings

__all__ = ["WINDOW_S", "TokenQuotas"]

WINDOW_S = 60.0


class _Window:
    __slots__ = ("events", "used")

    def __init__(self) -> None:
        self.events: deque[tuple[float, int]] = deque()  # (ended at, tokens), oldest first
        self.used = 0


class TokenQuotas:
    """The sliding windows of every key with a quota. Used on the event loop only.
    `clock`: monotonic seconds (tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def check(self, key: KeySettings | None) -> None:
        """Raise `QuotaExceeded` when `key` used its quota in the last 60 s."""
        if key is None or key.tokens_per_minute is None:
            return
        window = self._windows.get(key.name)
        if window is None:
            return
        now = self._clock()
        self._expire(window, now)
        limit = key.tokens_per_minute
        if window.used < limit:
            return
        # The first moment the window holds fewer than `limit` tokens.
        left, wait = window.used, WINDOW_S
        for ended, tokens in window.events:
            left -= tokens
            if left < limit:
                wait = ended + WINDOW_S - now
                break
        raise QuotaExceeded(
            f"the key {key.name!r} used its {limit} tokens per minute "
            f"({window.used} in the last {WINDOW_S:g} s); retry later",
            retry_after_s=max(1, math.ceil(wait)))

    def charge(self, key: KeySettings | None, tokens: int) -> None:
        """Count `tokens` (the request's prompt plus completion tokens) for `key`, now."""
        if key is None or key.tokens_per_minute is None or tokens <= 0:
            return
        window = self._windows.setdefault(key.name, _Window())
        now = self._clock()
        self._expire(window, now)
        window.events.append((now, tokens))
        window.used += tokens

    def used(self, key: KeySettings) -> int:
        """Tokens `key` used in the last 60 s."""
        window = self._windows.get(key.name)
        if window is None:
            return 0
        self._expire(window, self._clock())
        return window.used

    @staticmethod
    def _expire(window: _Window, now: float) -> None:
        events = window.events
        while events and events[0][0] <= now - WINDOW_S:
            window.used -= events.popleft()[1]
