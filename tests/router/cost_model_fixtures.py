"""What the measured-cost decider's tests share: four engine keys (2P2D), a clock the test
moves by hand, and a request decided inside its own request record (as the app does)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pdgate.router import request_context
from pdgate.router.input.schema import ClientRequest, CompletionParams
from pdgate.router.policies.measured_cost import MeasuredCostDecider
from pdgate.router.request_context import RequestRecord

P0, P1 = "http://127.0.0.1:9000", "http://127.0.0.1:9001"
D0, D1 = "http://127.0.0.1:9100", "http://127.0.0.1:9101"


class Clock:
    """A recorded clock: `t` seconds, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@contextmanager
def recorded(decider: MeasuredCostDecider, rid: str,
             tokens: int) -> Iterator[tuple[ClientRequest, RequestRecord]]:
    """A `tokens`-token completion request and its record, open as the current one (the
    decider watches the request through it) until the block ends."""
    record = RequestRecord("POST", "/v1/completions", arrival=decider._clock())
    token = request_context.open_record(record)
    try:
        yield ClientRequest("completion", "/v1/completions", {"prompt": "x"},
                            CompletionParams(prompt="x"), rid, {},
                            prompt_token_ids=list(range(tokens))), record
    finally:
        request_context.close_record(token)
