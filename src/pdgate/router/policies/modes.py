"""The measured-cost decider's hysteresis: each prompt-length bucket holds a mode (P then D, or
D alone) so that decisions do not flap on the noise of two close predictions
(router/policies/measured_cost.py says when a request takes the other mode). Pure: the
caller passes the time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Modes"]


@dataclass
class Modes:
    """Hysteresis: each bucket's held mode (True: D alone) and when it last changed."""

    margin: float
    min_dwell_s: float
    _mode: dict[int, tuple[bool, float]] = field(default_factory=dict)

    def choose(self, bucket: int, t_disagg: float, t_direct: float,
               now: float) -> tuple[bool, bool]:
        """(this request's mode, True: D alone; whether the bucket's held mode changed).

        Within `margin` of each other the held mode serves. A request whose other mode is
        predicted cheaper by more than `margin` takes it; the held mode follows at most
        once per `min_dwell_s`. Holding every request to the held mode through the dwell
        herded a burst: at 115 requests a second a 0.2 s dwell sent ~23 prompts in a row
        to one pool after its queue had passed the other's (docs/benchmarks.md)."""
        direct, since = self._mode.get(bucket, (False, -math.inf))
        current, other = (t_direct, t_disagg) if direct else (t_disagg, t_direct)
        if other * (1 + self.margin) >= current:
            return direct, False
        if now - since >= self.min_dwell_s:
            self._mode[bucket] = (not direct, now)
            return not direct, True
        return not direct, False

    def mode(self, bucket: int) -> bool:
        return self._mode.get(bucket, (False, 0.0))[0]
