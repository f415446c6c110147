"""Per-engine health: thresholded active checks, passive ejection, a circuit breaker.

Each `Endpoint` owns one `EngineHealth`. Two inputs feed it:

- active: `probe(ok)` with every periodic `GET /health` result. The verdict flips to
  unhealthy after `failure_threshold` failures in a row and back after `success_threshold`
  passes in a row (one flaky probe does not drop an engine).
- passive: `record_success()` / `record_failure()` from the orchestrator after each real
  leg (failures are errors that say the engine is broken: connect, reset, 5xx, timeout;
  a 4xx the client caused is a success).

Circuit breaker, per engine::

    closed --(eject_after failures in a row)--> open --(open_s elapsed)--> half-open
    half-open --(trial succeeds)--> closed;  half-open --(trial fails)--> open (again)

An open breaker takes the engine out of routing; half-open lets one request at a time
through (`admits(in_flight)`), so a recovering engine is not flooded. Everything runs on the
event loop; the clock is injectable for tests. Also `backoff_s`, the retry pause.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BreakerState", "EngineHealth", "HealthSettings", "backoff_s"]

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    """Circuit breaker state; `value` is what the admin API and metrics show."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """Thresholds (counts, >= 1) and the open period of the breaker (seconds)."""

    failure_threshold: int = 2
    success_threshold: int = 1
    eject_after: int = 3
    open_s: float = 10.0


class EngineHealth:
    """Health state of one engine (see module docstring). `name` is only for logs;
    `on_open` is called each time the breaker opens (a metric)."""

    def __init__(
        self,
        settings: HealthSettings | None = None,
        name: str = "",
        clock: Callable[[], float] = time.monotonic,
        on_open: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings or HealthSettings()
        self._on_open = on_open
        self.name = name
        self._clock = clock
        self._probed = False
        self._probe_fails = 0
        self._probe_passes = 0
        self.consecutive_errors = 0
        self._opened_at: float | None = None
        self._half_open = False
        self.ejections = 0

    def probe(self, ok: bool, healthy_now: bool) -> bool:
        """Record one active check; return the new healthy verdict (given the current one).
        The first check of an engine decides at once (no verdict to keep yet)."""
        if not self._probed:
            self._probed = True
            self._probe_fails, self._probe_passes = (0, 1) if ok else (1, 0)
            return ok
        if ok:
            self._probe_fails = 0
            self._probe_passes += 1
            if not healthy_now and self._probe_passes >= self.settings.success_threshold:
                return True
            return healthy_now
        self._probe_passes = 0
        self._probe_fails += 1
        if healthy_now and self._probe_fails >= self.settings.failure_threshold:
            return False
        return healthy_now

    @property
    def state(self) -> BreakerState:
        """The breaker state now (an open breaker turns half-open once `open_s` passed)."""
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._half_open or self._clock() - self._opened_at >= self.settings.open_s:
            self._half_open = True
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def admits(self, in_flight: int) -> bool:
        """May the engine take a new request? Closed: yes; open: no; half-open: only while
        nothing else is in flight on it (one trial at a time)."""
        if self._opened_at is None:
            return True
        state = self.state
        return state is BreakerState.HALF_OPEN and in_flight == 0

    def record_success(self) -> None:
        """A leg on this engine worked (or failed only by the client's fault)."""
        self.consecutive_errors = 0
        if self._opened_at is not None:
            log.info("engine %s: circuit breaker closed (trial request succeeded)", self.name)
            self._opened_at = None
            self._half_open = False

    def record_failure(self) -> None:
        """A leg on this engine failed in a way that blames the engine."""
        self.consecutive_errors += 1
        if self._opened_at is not None:
            if self.state is BreakerState.HALF_OPEN:
                self._open("trial request failed")
            return
        if self.consecutive_errors >= self.settings.eject_after:
            self._open(f"{self.consecutive_errors} failed requests in a row")

    def _open(self, why: str) -> None:
        self._opened_at = self._clock()
        self._half_open = False
        self.ejections += 1
        if self._on_open is not None:
            self._on_open()
        log.warning("engine %s: circuit breaker OPEN for %gs (%s)", self.name,
                    self.settings.open_s, why)


def backoff_s(attempt: int, base_s: float, cap_s: float = 1.0,
              rand: Callable[[], float] = random.random) -> float:
    """Pause before retry number `attempt` (1-based): `base_s * 2**(attempt-1)`, capped at
    `cap_s`, with full jitter in [50 %, 100 %] so synchronized clients spread out."""
    if base_s <= 0:
        return 0.0
    ceiling: float = min(cap_s, base_s * 2.0 ** (attempt - 1))
    return ceiling * (0.5 + 0.5 * rand())
