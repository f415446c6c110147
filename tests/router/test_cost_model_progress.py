"""The measured-cost decider counts what an engine has already computed of the prompt in
progress there: through the real policy runner, on a recorded clock."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import PickContext, build_policy, choose
from pdgate.router.policies.decider import PrefixDecider
from pdgate.router.policies.measured_cost import MeasuredCostDecider, MeasuredCostParams
from pdgate.router.pool import EndpointPool
from pdgate.router.request_context import RequestWatcher
from tests.router.cost_model_fixtures import D0, D1, P0, P1, Clock, recorded


async def _given_to_p0(decider: MeasuredCostDecider, pool: EndpointPool, rid: str
                       ) -> RequestWatcher:
    """A 1,500-token prompt decided P then D, its P leg given to P0."""
    with recorded(decider, rid, 1500) as (req, record):
        assert decider.decide(req).disagg
        p1 = pool.endpoints("prefill")[1]
        ep = await choose(pool, "prefill", build_policy("round-robin"), PickContext(rid),
                          exclude=[p1])
        assert ep.key == P0
        req.served_by["prefill"] = P0
    assert record.watcher is not None
    return record.watcher


async def test_the_prompt_in_progress_counts_only_what_is_left_of_it() -> None:
    clock = Clock()
    metrics = RouterMetrics.create(CollectorRegistry())
    pool = EndpointPool([P0, P1], [D0, D1], metrics)
    decider = MeasuredCostDecider(MeasuredCostParams(prior_tps=1000.0), PrefixDecider(),
                                  pool, metrics, clock, clock)
    first = await _given_to_p0(decider, pool, "r0")
    clock.t += 0.1
    await _given_to_p0(decider, pool, "r1")

    def queued() -> float:
        return decider.queues(pool.endpoints("prefill"), ())[P0]

    assert queued() == pytest.approx(3000 - 100)  # 0.1 s at 1,000 tokens/s of the first
    clock.t += 0.4
    assert queued() == pytest.approx(3000 - 500)  # the second waits its turn: still whole
    clock.t += 5.0
    assert queued() == pytest.approx(3000 - 1350)  # late: counted at most 90 % computed
    # The first is done: the second is in progress from then, not from when it was sent.
    first.prefill_done(1.5)  # 1,500 tokens at 1,000 tokens/s: the rate stays
    assert queued() == pytest.approx(1500)
    clock.t += 0.25
    assert queued() == pytest.approx(1500 - 250)
