"""The measured-cost decider and non-streaming requests, on recorded signals: their answer
comes whole and the router never sees their first token (router/metrics.py
`served_whole`). When the time to the whole answer was taken for one, a D alone that
generated for seconds taught D a prefill rate as slow as its whole answer, P then D an
overhead as long as D's generation, and the prediction ratio counted answers as TTFTs."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdgate.router import request_context
from pdgate.router.engine_load import EngineLoad
from pdgate.router.policies.cost_model import bucket_of
from pdgate.router.policies.measured_cost import MeasuredCostParams
from pdgate.router.request_context import RequestRecord
from tests.router.cost_model_fixtures import D0, P0, make, request, served

PARAMS = MeasuredCostParams(prior_tps=1000.0, alpha=1.0)


def ratio_count(registry: CollectorRegistry, choice: str) -> float:
    got = registry.get_sample_value("pdgate_decider_prediction_ratio_count",
                                    {"choice": choice})
    return got or 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_p_then_d_learns_its_p_leg_and_only_a_stream_its_overhead(stream: bool) -> None:
    decider, _, metrics, clock = make(PARAMS)
    # A stream's first token 2.5 s after P's leg (a slow transfer); a whole answer, none.
    served(decider, request(1000, stream=stream), {"prefill": P0, "decode": D0}, clock.t,
           prefill_s=0.5, first_s=3.0 if stream else None)
    assert decider.model.rate(P0, 1000) == pytest.approx(2000.0)  # the P leg, either way
    assert decider.model.overhead(1000) == pytest.approx(2.5 if stream else 0.0)
    assert ratio_count(metrics, "disagg") == (1.0 if stream else 0.0)


@pytest.mark.parametrize("stream", [True, False])
def test_d_alone_learns_ds_rate_from_a_first_token_only(stream: bool) -> None:
    decider, pool, metrics, clock = make(PARAMS)
    for ep in pool.endpoints("prefill"):  # P congested: long prompts go to D alone
        ep.load = EngineLoad(8.0, 2.0, 0.5, clock.t)
    served(decider, request(1000, stream=stream), {"decode": D0}, clock.t,
           prefill_s=None, first_s=4.0 if stream else None)
    assert decider.modes.mode(bucket_of(1000)) is True  # it went to D alone
    # A stream's first token after 4 s: D computes 250 tokens/s. A whole answer says
    # nothing of D's prefill: the prior stands.
    assert decider.model.rate(D0, 1000) == pytest.approx(250.0 if stream else 1000.0)
    assert ratio_count(metrics, "direct") == (1.0 if stream else 0.0)


def test_a_non_streaming_d_alone_leaves_ds_queue_when_its_first_token_is_due() -> None:
    """Its first token is never seen: its prompt stops counting in D's queue once the time
    predicted for it has passed, not when its whole answer is back."""
    decider, pool, _, clock = make(PARAMS)
    for ep in pool.endpoints("prefill"):
        ep.load = EngineLoad(8.0, 2.0, 0.5, clock.t)
    queued = {}
    for stream in (True, False):
        record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
        token = request_context.open_record(record)
        try:
            req = request(1000, f"s{stream}", stream=stream)
            assert decider.decide(req).reason == "cost_direct"
            assert record.watcher is not None
            record.watcher.sent("decode", D0)
        finally:
            request_context.close_record(token)
        queued[stream] = record
    decode = pool.endpoints("decode")
    assert decider.queues((), decode)[D0] > 1000.0  # both prompts, the earliest in progress
    clock.t += 2.0  # the later one was predicted 2 s (1 s behind the first, at 1,000/s)
    assert decider.queues((), decode)[D0] == pytest.approx(100.0)  # the stream: 90 % done
    clock.t += 60.0  # the non-streaming answer is still generating
    assert decider.queues((), decode)[D0] == pytest.approx(100.0)


def test_d_alone_is_not_probed_with_a_non_streaming_request() -> None:
    params = MeasuredCostParams(prior_tps=1000.0, probe_s=5.0)
    decider, _, _, clock = make(params)
    assert decider.decide(request(1000)).reason == "cost_disagg"  # the bucket's first
    assert decider.modes.mode(bucket_of(1000)) is False
    clock.t += 5.0
    # D alone would measure nothing: a non-streaming answer shows no first token.
    assert decider.decide(request(1000, "plain", stream=False)).reason == "cost_disagg"
    d = decider.decide(request(1000, "stream"))
    assert (d.disagg, d.reason) == (False, "probe")
