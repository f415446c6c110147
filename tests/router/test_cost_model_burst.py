"""A burst decided inside the dwell: the measured-cost decider splits it between the pools
as their queues grow instead of holding every request to the bucket's mode (herding).
Through the real decider and the policy runner, on a recorded clock."""

from __future__ import annotations

from collections import Counter
from typing import Literal

from prometheus_client import CollectorRegistry

from pdgate.router.engine_load import EngineLoad
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import PickContext, build_policy, choose
from pdgate.router.policies.decider import PrefixDecider
from pdgate.router.policies.measured_cost import MeasuredCostDecider, MeasuredCostParams
from pdgate.router.pool import EndpointPool
from tests.router.cost_model_fixtures import D0, D1, P0, P1, Clock, recorded


async def _decide_and_give(decider: MeasuredCostDecider, pool: EndpointPool,
                           rid: str) -> tuple[str, float]:
    """Decide a 1,000-token prompt and give the leg computing it to an engine (the runner
    takes the decider's preferred one): (reason, predicted TTFT)."""
    with recorded(decider, rid, 1000) as (req, record):
        d = decider.decide(req)
        role: Literal["prefill", "decode"] = "prefill" if d.disagg else "decode"
        ep = await choose(pool, role, build_policy("round-robin"), PickContext(rid))
        req.served_by[role] = ep.key
    assert record.predicted_ttft_s is not None
    return d.reason, record.predicted_ttft_s


async def test_a_burst_inside_the_dwell_is_split_between_the_pools() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    metrics = RouterMetrics.create(registry)
    pool = EndpointPool([P0, P1], [D0, D1], metrics)
    # The default 1 s dwell; 1,000 tokens/s everywhere; no ITL guard (the Ds are idle).
    decider = MeasuredCostDecider(MeasuredCostParams(prior_tps=1000.0, itl_stall_s=0.0),
                                  PrefixDecider(), pool, metrics, clock, clock)
    assert (await _decide_and_give(decider, pool, "warm"))[0] == "cost_disagg"
    for ep in pool.endpoints("prefill"):  # other routers' work: 6 prompts queued on each P
        ep.load = EngineLoad(4.0, 2.0, 0.5, clock.t)
    got = [await _decide_and_give(decider, pool, f"r{i}") for i in range(40)]
    reasons = Counter(reason for reason, _ in got)
    # The first goes to D alone (the bucket switches); D's queue grows with each, and once
    # D alone is predicted slower than P then D by more than the margin the next goes
    # through P, though the bucket holds D alone for its dwell (no time passes here).
    # Holding all 40 to the mode would queue 20 prompts (20 s) on each D.
    assert 10 <= reasons["cost_direct"] <= 30 and reasons["cost_disagg"] >= 10, reasons
    # The pools' queues grow together: the last of each mode was predicted within about
    # the margin of the other's (here 15 s and 12 s: the
    # queues step by a whole prompt).
    last = {r: next(t for reason, t in reversed(got) if reason == r) for r in reasons}
    assert last["cost_direct"] <= 1.3 * last["cost_disagg"], got
    assert registry.get_sample_value("pdgate_decider_switches_total", {"to": "direct"}) == 1.0
    overrides = registry.get_sample_value("pdgate_decider_overrides_total", {"to": "disagg"})
    assert overrides == reasons["cost_disagg"]  # each inside the dwell
