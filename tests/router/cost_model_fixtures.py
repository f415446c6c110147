"""What the measured-cost decider's tests share: four engine keys (2P2D), a clock the test
moves by hand, a decider over them (`make`), requests (`request`; `recorded`: decided inside
its own request record, as the app does) and one served with what it measured (`served`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from pdgate.router import request_context
from pdgate.router.input.schema import ClientRequest, CompletionParams
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies.decider import PrefixDecider
from pdgate.router.policies.measured_cost import MeasuredCostDecider, MeasuredCostParams
from pdgate.router.pool import EndpointPool
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
    """A `tokens`-token streaming completion request and its record, open as the current
    one (the decider watches the request through it) until the block ends."""
    record = RequestRecord("POST", "/v1/completions", arrival=decider._clock())
    token = request_context.open_record(record)
    try:
        yield ClientRequest("completion", "/v1/completions", {"prompt": "x", "stream": True},
                            CompletionParams(prompt="x", stream=True), rid, {},
                            prompt_token_ids=list(range(tokens))), record
    finally:
        request_context.close_record(token)


def make(params: MeasuredCostParams | None = None, static: PrefixDecider | None = None,
         ) -> tuple[MeasuredCostDecider, EndpointPool, CollectorRegistry, Clock]:
    registry = CollectorRegistry()
    metrics = RouterMetrics.create(registry)
    pool = EndpointPool([P0, P1], [D0, D1], metrics)
    clock = Clock()
    decider = MeasuredCostDecider(params or MeasuredCostParams(prior_tps=1000.0),
                                  static or PrefixDecider(), pool, metrics, clock, clock)
    return decider, pool, registry, clock


def request(tokens: int, rid: str = "r1", *, stream: bool = True,
            **fields: int) -> ClientRequest:
    """A `tokens`-token completion request; streaming unless told (the first token the
    decider learns from is a streamed one's)."""
    return ClientRequest("completion", "/v1/completions",
                         {"prompt": "x", "stream": stream, **fields},
                         CompletionParams(prompt="x", stream=stream, **fields), rid, {},
                         prompt_token_ids=list(range(tokens)))


def served(decider: MeasuredCostDecider, req: ClientRequest, role_keys: dict[str, str],
            arrival: float, prefill_s: float | None, first_s: float | None) -> RequestRecord:
    """One request through the decider with a current record, then what it measured."""
    record = RequestRecord("POST", "/v1/completions", arrival=arrival)
    token = request_context.open_record(record)
    try:
        decider.decide(req)
        req.served_by.update(role_keys)
        watcher = record.watcher
        assert watcher is not None
        if prefill_s is not None:
            watcher.prefill_done(prefill_s)
        if first_s is not None:  # None: a non-streaming answer, its first token unseen
            watcher.first_token(first_s)
        watcher.ended()
    finally:
        request_context.close_record(token)
    return record
