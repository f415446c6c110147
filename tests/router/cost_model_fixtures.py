"""What the measured-cost decider's tests share: four engine keys (2P2D) and a clock the
test moves by hand."""

from __future__ import annotations

P0, P1 = "http://127.0.0.1:9000", "http://127.0.0.1:9001"
D0, D1 = "http://127.0.0.1:9100", "http://127.0.0.1:9101"


class Clock:
    """A recorded clock: `t` seconds, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
