"""The measured-cost decider on recorded signals: the predictor's learning and fallbacks, the
hysteresis, the guard and the bounds, and learning from what a request measured."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdgate.router import request_context
from pdgate.router.config import ConfigError, PolicySpec
from pdgate.router.engine_load import EngineLoad
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import PickContext, build_policy, choose
from pdgate.router.policies.cost_model import CostModel, Queue, bucket_of
from pdgate.router.policies.decider import PrefixDecider
from pdgate.router.policies.measured_cost import MeasuredCostDecider, MeasuredCostParams
from pdgate.router.policies.modes import Modes
from pdgate.router.policies.setup import build_decider
from pdgate.router.pool import EndpointPool
from pdgate.router.request_context import RequestRecord
from tests.router.cost_model_fixtures import D0, D1, P0, P1, make, recorded, request, served


@pytest.mark.parametrize(("n", "bucket"), [
    (1, 0), (255, 0), (256, 1), (511, 1), (512, 2), (4000, 4), (4096, 5), (10**7, 10)])
def test_buckets_double(n: int, bucket: int) -> None:
    assert bucket_of(n) == bucket


def test_rates_learn_from_recorded_prefills_and_borrow_until_measured() -> None:
    m = CostModel(alpha=0.5, prior_tps=1000.0)
    assert m.rate(P0, 1000) == 1000.0  # nothing measured: the prior
    # Recorded P legs on P0: 1000 tokens behind 1000 queued in 1 s, then alone in 0.5 s.
    m.learn_prefill(Queue(P0, 1000), 1000, 1.0)
    assert m.rate(P0, 1000) == 2000.0
    m.learn_prefill(Queue(P0, 0), 1000, 0.25)
    assert m.rate(P0, 1000) == 3000.0  # EWMA: 2000 + 0.5 * (4000 - 2000)
    # Another bucket of P0: its nearest measured bucket; another engine: this bucket's mean.
    assert m.rate(P0, 200) == 3000.0
    assert m.rate(D0, 1000) == 3000.0
    m.learn_prefill(Queue(D0, 0), 1000, 1.0)
    assert m.rate(D0, 1000) == 1000.0
    assert m.rate(P1, 1000) == 2000.0  # mean of P0's and D0's
    # Predictions: queue + prompt over the rate.
    assert m.prefill_s(Queue(P0, 2000), 1000) == pytest.approx(1.0)
    assert m.prefill_s(Queue(D0, 0), 1000) == pytest.approx(1.0)
    # Noise is not learnt.
    m.learn_prefill(Queue(P0, 0), 1000, 0.0)
    assert m.rate(P0, 1000) == 3000.0


def test_an_unmeasured_bucket_borrows_the_same_bucket_of_other_engines_first() -> None:
    """A short prompt's rate is mostly its fixed cost per request: D0's first 64-token prompt
    takes P0's figure for that length (3,200 tokens/s), not D0's own long prompts' (75,000,
    which predicted 1 ms for what took ~50 ms on a 4-GPU host)."""
    m = CostModel(alpha=1.0, prior_tps=1000.0)
    m.learn_prefill(Queue(P0, 0), 1500, 0.02)
    m.learn_prefill(Queue(P0, 0), 64, 0.02)
    m.learn_prefill(Queue(D0, 0), 1500, 0.02)
    assert m.rate(D0, 64) == pytest.approx(3_200)
    assert m.prefill_s(Queue(D0, 0), 64) == pytest.approx(0.02)
    # No engine measured the bucket: the engine's nearest bucket.
    assert m.rate(D0, 600) == pytest.approx(75_000)


def test_a_queue_runs_at_its_own_prompts_rate() -> None:
    """Recorded on a 2-GPU host: a 1,500-token prompt alone took 20 ms, a 64-token one 20 ms
    too (the engine's fixed cost per request). A short prompt behind a long one takes both,
    not 1,564 tokens at the short bucket's "rate"."""
    m = CostModel(alpha=1.0, prior_tps=1000.0)
    m.learn_prefill(Queue(P0, 0), 1500, 0.02)
    m.learn_prefill(Queue(P0, 0), 64, 0.02)
    assert (m.rate(P0, 1500), m.rate(P0, 64)) == (pytest.approx(75_000), pytest.approx(3_200))
    assert m.prefill_s(Queue(P0, 1500, 1500), 64) == pytest.approx(0.02 + 0.02)
    assert m.prefill_s(Queue(P0, 1500), 64) == pytest.approx(1564 / 3200)  # length unknown
    # Queued prompts as long as the request's: one rate for all.
    assert m.prefill_s(Queue(P0, 1500, 1400), 1500) == pytest.approx(3000 / 75_000)
    # Learning: what is left after the queue's predicted time is the prompt's own...
    m.learn_prefill(Queue(P0, 1500, 1500), 64, 0.05)
    assert m.rate(P0, 64) == pytest.approx(64 / 0.03)
    # ...and at least a quarter of what was measured (the queue drained faster).
    m.learn_prefill(Queue(P0, 15_000, 1500), 64, 0.05)
    assert m.rate(P0, 64) == pytest.approx(64 / 0.0125)


def test_overhead_is_learnt_per_bucket() -> None:
    m = CostModel(alpha=1.0)
    assert m.overhead(1000) == 0.0
    m.learn_overhead(1000, 0.05)
    assert m.overhead(1000) == 0.05 and m.overhead(100) == 0.0
    assert m.prefill_s(Queue(P0, 0), 1000) + m.overhead(1000) == pytest.approx(
        1000 / 2000 + 0.05)


# Recorded predictions (time s, P then D s, D alone s) -> each request's mode (True: D
# alone) and the bucket's held mode after it.
HYSTERESIS = [
    # D alone cheaper, but by less than the 20 % margin: stays disaggregated.
    ([(0.0, 1.0, 0.9), (0.1, 1.0, 0.85)], [False, False], [False, False]),
    # Cheaper by more: switches; then P recovers a little (inside the margin): holds.
    ([(0.0, 1.0, 0.5), (0.1, 0.45, 0.5), (0.2, 0.42, 0.5)], [True] * 3, [True] * 3),
    # P cheaper by more than the margin inside the 1 s dwell: that request goes through P,
    # the bucket keeps D alone until the dwell is over.
    ([(0.0, 1.0, 0.5), (0.5, 0.2, 0.5), (1.2, 0.2, 0.5)], [True, False, False],
     [True, True, False]),
    # Alternating predictions beyond the margin: each request takes the cheaper mode, and
    # the held mode (the one that serves inside the margin) changes once per dwell at most.
    ([(t / 10, 1.0 if t % 2 else 0.2, 0.5) for t in range(20)],
     [bool(t % 2) for t in range(20)], [False] + [True] * 11 + [False] * 8),
]


@pytest.mark.parametrize(("signals", "decisions", "held"), HYSTERESIS)
def test_hysteresis_on_recorded_predictions(
    signals: list[tuple[float, float, float]], decisions: list[bool], held: list[bool],
) -> None:
    h = Modes(margin=0.2, min_dwell_s=1.0)
    got, got_held = [], []
    for t, t_pd, t_d in signals:
        got.append(h.choose(3, t_pd, t_d, t)[0])
        got_held.append(h.mode(3))
    assert (got, got_held) == (decisions, held)
    assert h.mode(4) is False  # other buckets start disaggregated


def test_a_congested_prefill_pool_sends_long_prompts_to_idle_decoders() -> None:
    decider, pool, metrics, clock = make()
    assert decider.decide(request(1000)).reason == "cost_disagg"  # both idle: the static mode
    for ep in pool.endpoints("prefill"):  # every P's own queue: 6 requests (other routers')
        ep.load = EngineLoad(4.0, 2.0, 0.5, clock.t)
    d = decider.decide(request(1000))
    assert (d.disagg, d.reason) == (False, "cost_direct")
    assert metrics.get_sample_value("pdgate_decider_switches_total",
                                             {"to": "direct"}) == 1.0
    # Short prompts are another bucket, still in its own (disaggregated) mode until its
    # predictions differ by the margin too.
    assert decider.decide(request(100)).reason in {"cost_direct", "cost_disagg"}
    # Stale figures are ignored: back to equal predictions, the bucket holds D alone
    # (hysteresis) until P is predicted cheaper by the margin.
    clock.t += 6
    assert decider.decide(request(1000)).reason == "cost_direct"


def test_bounds_and_the_decode_itl_guard() -> None:
    params = MeasuredCostParams(prior_tps=1000.0, max_direct_tokens=3000, itl_stall_s=0.5,
                                min_dwell_s=0.0)
    decider, pool, _, clock = make(params, PrefixDecider(min_tokens=64))
    for ep in pool.endpoints("prefill"):
        ep.load = EngineLoad(20.0, 0.0, 0.9, clock.t)
    assert decider.decide(request(10)).reason == "short_prompt"  # the static bound
    assert decider.decide(request(4000)).reason == "long_prompt"  # the operator's bound
    assert decider.decide(request(400, n=2)).reason == "n_gt_1"
    assert decider.decide(request(400)).reason == "cost_direct"  # 0.4 s stall: allowed
    for ep in pool.endpoints("decode"):
        ep.in_flight = 3  # D is decoding: a 0.8 s prefill would stall those streams
    d = decider.decide(request(800))
    assert (d.disagg, d.reason) == (True, "decode_itl_guard")  # the bound, not the cost
    assert decider.decide(request(400)).reason == "cost_direct"
    # The engines' last read still shows one running request, which was this router's and
    # has ended since: no stall. One running request of another router's is one.
    for ep in pool.endpoints("decode"):
        ep.in_flight = 0
        ep.load = EngineLoad(0.0, 1.0, 0.1, clock.t, mine=1)
    assert decider.decide(request(800)).reason == "cost_direct"
    for ep in pool.endpoints("decode"):
        ep.load = EngineLoad(0.0, 2.0, 0.1, clock.t, mine=1)
    assert decider.decide(request(800)).reason == "decode_itl_guard"


def test_the_delay_d_alone_adds_to_running_streams_counts_against_it() -> None:
    """D alone's prefill (0.5 s here) delays every stream running on that D by as much: it
    is taken only where it saves its request more than it costs them (`stall_weight` 1),
    on the D where the sum is least. No hard ITL bound here (`itl_stall_s` 0)."""
    params = MeasuredCostParams(prior_tps=1000.0, min_dwell_s=0.0, itl_stall_s=0.0)
    decider, pool, _, clock = make(params)
    for ep in pool.endpoints("prefill"):  # one queued prompt each: P then D takes 1.0 s
        ep.load = EngineLoad(1.0, 0.0, 0.5, clock.t)
    assert decider.decide(request(500)).reason == "cost_direct"  # idle D: 0.5 s
    d0, d1 = pool.endpoints("decode")
    d0.in_flight = d1.in_flight = 2  # 0.5 s saved, 2 x 0.5 s of stall
    d = decider.decide(request(500))
    assert (d.disagg, d.reason) == (True, "decode_stall_cost")
    # Not counted (weight 0): the same signals take D alone.
    free, _, _, clock0 = make(MeasuredCostParams(prior_tps=1000.0, min_dwell_s=0.0,
                                                 itl_stall_s=0.0, stall_weight=0.0))
    for ep in free.pool.endpoints("prefill"):
        ep.load = EngineLoad(1.0, 0.0, 0.5, clock0.t)
    for ep in free.pool.endpoints("decode"):
        ep.in_flight = 2
    assert free.decide(request(500)).reason == "cost_direct"
    # A D with no streams but a queued prompt (0.3 s) is cheaper than one with two streams
    # and nothing queued (0.5 s + 1.0 s of stall): the prompt goes there.
    d1.in_flight = 0
    d1.load = EngineLoad(0.6, 0.0, 0.1, clock.t)  # 0.6 x the mean prompt (500)
    with recorded(decider, "r2", 500) as (req, record):
        assert decider.decide(req).reason == "cost_direct"
        assert record.predicted_ttft_s == pytest.approx(0.8)  # its TTFT, not the cost
        assert record.watcher is not None
        assert record.watcher.preferred("decode") == D1


def test_a_mode_left_unmeasured_is_probed_and_what_the_probe_measures_counts() -> None:
    """A bucket held in one mode never measures the other: after `probe_s` one request
    takes it (reason `probe`, one at a time), and its measurement can switch the bucket."""
    params = MeasuredCostParams(prior_tps=1000.0, probe_s=5.0, min_dwell_s=0.0, alpha=1.0)
    decider, pool, metrics, clock = make(params)
    for ep in pool.endpoints("prefill"):  # P congested as the engines last reported
        ep.load = EngineLoad(8.0, 2.0, 0.5, clock.t)
    # D alone measured slow on both Ds (1 s for 1,000 tokens): nothing shows P got faster.
    for i, d in enumerate((D0, D1)):
        served(decider, request(1000, f"d{i}"), {"decode": d}, clock.t, None, 1.0)
    assert decider.modes.mode(bucket_of(1000)) is True  # D alone
    clock.t += 4.0
    assert decider.decide(request(1000)).reason == "cost_direct"  # not yet due
    clock.t += 1.0
    for ep in pool.endpoints("prefill"):
        ep.load = EngineLoad(8.0, 2.0, 0.5, clock.t)
    record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
    token = request_context.open_record(record)
    try:
        probe = request(1000, "probe")
        d = decider.decide(probe)
    finally:
        request_context.close_record(token)
    assert (d.disagg, d.reason) == (True, "probe")
    # The probe is out: the next request keeps the bucket's mode.
    assert decider.decide(request(1000, "r3")).reason == "cost_direct"
    # P answered fast: its queue had drained (the engines' read was stale).
    probe.served_by.update({"prefill": P0, "decode": D0})
    assert record.watcher is not None
    record.watcher.prefill_done(0.1)
    record.watcher.first_token(0.11)
    record.watcher.ended()
    for ep in pool.endpoints("prefill"):
        ep.load = EngineLoad(0.0, 0.0, 0.1, clock.t)
    # The bucket switches back to P then D; D alone, unmeasured for 5 s now, is probed.
    d = decider.decide(request(1000, "r4"))
    assert decider.modes.mode(bucket_of(1000)) is False
    assert (d.disagg, d.reason) == (False, "probe")
    assert decider.decide(request(1000, "r5")).reason == "cost_disagg"


def test_an_idle_router_does_not_probe_its_first_request() -> None:
    decider, _, _, clock = make(MeasuredCostParams(prior_tps=1000.0, probe_s=5.0))
    clock.t += 3600.0
    assert decider.decide(request(1000)).reason == "cost_disagg"
    clock.t += 5.0
    assert decider.decide(request(1000)).reason == "probe"


def test_a_probe_to_a_busy_decoder_is_held_by_the_itl_guard() -> None:
    params = MeasuredCostParams(prior_tps=1000.0, probe_s=5.0, itl_stall_s=0.5)
    decider, pool, _, clock = make(params)
    assert decider.decide(request(1000)).reason == "cost_disagg"  # the bucket's first
    for ep in pool.endpoints("decode"):
        ep.in_flight = 2  # decoding: a 1 s prefill would stall them
    clock.t += 5.0
    d = decider.decide(request(1000))
    assert (d.disagg, d.reason) == (True, "decode_itl_guard")


def test_no_prefill_engine_keeps_the_static_answer() -> None:
    decider, pool, _, _ = make()
    for ep in pool.endpoints("prefill"):
        ep.set_healthy(False)
    assert decider.decide(request(1000)).reason == "disagg"  # the flow falls back itself


def test_requests_teach_the_predictor_and_the_ratio_is_observed() -> None:
    decider, _, metrics, clock = make(MeasuredCostParams(prior_tps=1000.0, alpha=1.0))
    record = served(decider, request(1000), {"prefill": P0, "decode": D0}, clock.t,
                     prefill_s=0.5, first_s=0.55)
    assert record.predicted_ttft_s == pytest.approx(1.0)  # prior: 1000 tokens at 1000/s
    assert decider.model.rate(P0, 1000) == pytest.approx(2000.0)
    assert decider.model.overhead(1000) == pytest.approx(0.05)
    ratio = metrics.get_sample_value("pdgate_decider_prediction_ratio_sum",
                                     {"choice": "disagg"})
    assert ratio == pytest.approx(0.55)  # measured 0.55 s of a predicted 1.0 s
    assert decider._pending == {}  # ended: nothing left queued
    # The next request is predicted from what was learnt.
    # (D alone, at P's rate borrowed, is 0.5 s: within the 20 % margin, so P then D holds.)
    record = served(decider, request(1000, "r2"), {"prefill": P0, "decode": D0}, clock.t,
                     prefill_s=0.5, first_s=0.6)
    assert record.decision is None and decider.modes.mode(bucket_of(1000)) is False
    assert record.predicted_ttft_s == pytest.approx(0.5 + 0.05)


def test_requests_in_their_prefill_count_as_that_engines_queue() -> None:
    decider, _, _, clock = make()
    record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
    token = request_context.open_record(record)
    try:
        req = request(1500)
        decider.decide(req)
        req.served_by["prefill"] = P0
    finally:
        request_context.close_record(token)
    q = decider.queues(decider.pool.endpoints("prefill"), decider.pool.endpoints("decode"))
    assert q == {P0: 1500.0, P1: 0.0, D0: 0.0, D1: 0.0}
    assert record.watcher is not None
    record.watcher.prefill_done(1.0)
    q = decider.queues(decider.pool.endpoints("prefill"), decider.pool.endpoints("decode"))
    assert q[P0] == 0.0


async def test_a_burst_counts_each_request_where_its_leg_was_given() -> None:
    """Requests decided back to back (a burst) see each other: one decided but not yet given
    to an engine counts as a share on each engine of its role, and once the runner chose its
    engine (before any byte is back) it counts there in full (engines picked by the
    policy: `pick_engines` off)."""
    decider, pool, _, clock = make(MeasuredCostParams(prior_tps=1000.0, min_dwell_s=0.0,
                                                      pick_engines=False))
    for ep in pool.endpoints("prefill"):  # a congested P pool: D alone is cheaper
        ep.load = EngineLoad(8.0, 2.0, 0.5, clock.t)
    records, reqs = [], []
    for i in range(2):
        record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
        token = request_context.open_record(record)
        try:
            reqs.append(request(1000, f"r{i}"))
            assert decider.decide(reqs[-1]).reason == "cost_direct"
        finally:
            request_context.close_record(token)
        records.append(record)
    # Neither leg was given yet: 2 x 1000 tokens, half on each D.
    q = decider.queues(pool.endpoints("prefill"), pool.endpoints("decode"))
    assert (q[D0], q[D1]) == (1000.0, 1000.0)
    assert records[1].predicted_ttft_s == pytest.approx((1000 + 500) / 1000)
    token = request_context.open_record(records[0])
    try:
        ep = await choose(pool, "decode", build_policy("round-robin"), PickContext("r0"))
    finally:
        request_context.close_record(token)
    q = decider.queues(pool.endpoints("prefill"), pool.endpoints("decode"))
    other = D1 if ep.key == D0 else D0
    assert (q[ep.key], q[other]) == (1500.0, 500.0)
    watcher = records[0].watcher
    assert watcher is not None
    watcher.first_token(1.0)  # its prompt is computed: no longer queued
    q = decider.queues(pool.endpoints("prefill"), pool.endpoints("decode"))
    assert (q[ep.key], q[other]) == (500.0, 500.0)


async def test_the_prompt_goes_to_the_engine_it_was_predicted_on() -> None:
    """With `pick_engines` (the default) the decision picks the engine too: a direct prompt
    goes to the D with the least queued work, even where the decode policy
    (`least-inflight`: counts of requests) would pick the other; a burst spreads over the
    pool as it is decided; a disaggregated prompt goes to the least loaded P."""
    # Queued work alone: the stall D0's three streams would suffer is another test's.
    decider, pool, _, clock = make(MeasuredCostParams(prior_tps=1000.0, min_dwell_s=0.0,
                                                      stall_weight=0.0))
    for ep in pool.endpoints("prefill"):  # a congested P pool: D alone is cheaper
        ep.load = EngineLoad(8.0, 2.0, 0.5, clock.t)
    d0, d1 = pool.endpoints("decode")
    d0.load = EngineLoad(0.0, 0.0, 0.1, clock.t)
    d1.load = EngineLoad(2.0, 0.0, 0.1, clock.t)  # two queued prompts on D1 (another router)
    d0.in_flight = 3  # three short streams of ours on D0: least-inflight would take D1
    policy = build_policy("least-inflight")
    got = []
    for i in range(2):
        record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
        token = request_context.open_record(record)
        try:
            assert decider.decide(request(1000, f"r{i}")).reason == "cost_direct"
            got.append((await choose(pool, "decode", policy, PickContext(f"r{i}"))).key)
        finally:
            request_context.close_record(token)
    # D1's two queued prompts (x the mean prompt, 1,000) outweigh D0's three decodes, and
    # the first direct prompt counts on D0 as soon as it is decided (1,003 < 2,000 / 1.2).
    assert got == [D0, D0]
    # An excluded engine (a retry) is not forced: the policy picks among the rest.
    record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
    token = request_context.open_record(record)
    try:
        decider.decide(request(1000, "r9"))
        assert record.watcher is not None
        tried = d0 if record.watcher.preferred("decode") == D0 else d1
        ep = await choose(pool, "decode", policy, PickContext("r9"), exclude=[tried])
        assert ep is not tried
    finally:
        request_context.close_record(token)
    # P then D: the P leg goes to the P with less queued (P1 here).
    for ep in pool.endpoints("prefill"):
        ep.load = None
    decider.modes = Modes(0.2, 0.0)  # back to P then D
    p0, p1 = pool.endpoints("prefill")
    p0.load = EngineLoad(1.0, 0.0, 0.1, clock.t)
    record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
    token = request_context.open_record(record)
    try:
        assert decider.decide(request(1000, "r10")).disagg
        ep = await choose(pool, "prefill", build_policy("round-robin"), PickContext("r10"))
        assert ep.key == P1
    finally:
        request_context.close_record(token)


async def test_a_disaggregated_requests_decode_leg_avoids_a_d_about_to_prefill() -> None:
    """P then D with `pick_engines`: the D leg, chosen when P is done, goes to the D with the
    least prompt work queued, not to the one `least-inflight` would take (fewer streams,
    but a long direct prompt about to be computed there, which would stall the new stream)."""
    decider, pool, _, clock = make(MeasuredCostParams(prior_tps=1000.0, min_dwell_s=0.0,
                                                      itl_stall_s=0.5))
    d0, d1 = pool.endpoints("decode")
    d1.in_flight = 2  # two streams of ours on D1 (D alone goes to D0: it would stall D1's)
    policy = build_policy("least-inflight")
    # A direct prompt of 1,000 tokens decided for D0 and not yet computed there.
    decider.modes._mode[bucket_of(1000)] = (True, 0.0)
    record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
    token = request_context.open_record(record)
    try:
        assert decider.decide(request(1000, "direct")).reason == "cost_direct"
        assert record.watcher is not None and record.watcher.preferred("decode") == D0
    finally:
        request_context.close_record(token)
    # A short prompt through P then D (its own bucket holds P then D).
    record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
    token = request_context.open_record(record)
    try:
        assert decider.decide(request(100, "pd")).disagg
        await choose(pool, "prefill", build_policy("round-robin"), PickContext("pd"))
        ep = await choose(pool, "decode", policy, PickContext("pd"))
        assert ep is d1  # least-inflight alone would take D0
        assert record.watcher is not None
        record.watcher.first_token(0.1)
    finally:
        request_context.close_record(token)
    # Without pick_engines the policy picks the D leg.
    decider.params = MeasuredCostParams(prior_tps=1000.0, pick_engines=False)
    record = RequestRecord("POST", "/v1/completions", arrival=clock.t)
    token = request_context.open_record(record)
    try:
        assert decider.decide(request(100, "pd2")).disagg
        ep = await choose(pool, "decode", policy, PickContext("pd2"))
        assert ep is d0
    finally:
        request_context.close_record(token)


def test_engines_predicted_alike_share_the_work() -> None:
    """Learnt rates are noisy averages: idle engines within the margin of each other take
    prompts in turn; one clearly slower is left out."""
    decider, pool, _, _ = make(MeasuredCostParams(prior_tps=1000.0, alpha=1.0))
    decider.model.learn_prefill(Queue(P0, 0), 1000, 0.50)
    decider.model.learn_prefill(Queue(P1, 0), 1000, 0.55)  # 10 % slower: an equal
    picks = []
    for i in range(4):
        record = RequestRecord("POST", "/v1/completions", arrival=0.0)
        token = request_context.open_record(record)
        try:
            decider.decide(request(1000, f"r{i}"))
            assert record.watcher is not None
            picks.append(record.watcher.preferred("prefill"))
            record.watcher.prefill_done(0.5)  # done: the pool is idle again
        finally:
            request_context.close_record(token)
    assert sorted(picks) == [P0, P0, P1, P1]
    decider.model.learn_prefill(Queue(P1, 0), 1000, 1.0)  # now half as fast
    record = RequestRecord("POST", "/v1/completions", arrival=0.0)
    for i in range(4):
        token = request_context.open_record(record)
        try:
            decider.decide(request(1000, f"s{i}"))
            assert record.watcher is not None
            assert record.watcher.preferred("prefill") == P0
            record.watcher.prefill_done(0.5)
        finally:
            request_context.close_record(token)


def test_decider_specs() -> None:
    pool = EndpointPool([P0], [D0], RouterMetrics.create(CollectorRegistry()))
    static = PrefixDecider()
    assert build_decider("static", static, pool) is static
    built = build_decider(PolicySpec("measured-cost", params={"margin": 0.5}), static, pool)
    assert isinstance(built, MeasuredCostDecider) and built.params.margin == 0.5
    assert built.needs_tokens and built.reads_engine_load
    with pytest.raises(ConfigError, match="margin"):
        build_decider(PolicySpec("measured-cost", params={"margin": -1}), static, pool)
    with pytest.raises(ConfigError, match="unknown type 'fastest'"):
        build_decider("fastest", static, pool)
    with pytest.raises(ConfigError, match="takes no params"):
        build_decider(PolicySpec("static", params={"x": 1}), static, pool)


def test_capacity_signal_and_recommended_ratio() -> None:
    params = MeasuredCostParams(prior_tps=1000.0, target_queue_s=1.0, target_kv_usage=0.8)
    decider, pool, registry, clock = make(params)
    assert decider.pressure() == (0.0, None) and decider.recommended_ratio() is None
    assert registry.get_sample_value("pdgate_pd_pressure", {"role": "prefill"}) == 0.0
    decider.decide(request(1000))  # the mean prompt: 1000 tokens
    for ep in pool.endpoints("prefill"):  # 3 requests queued on each P: 3000 tokens each
        ep.load = EngineLoad(3.0, 0.0, 0.5, clock.t)
    for ep, usage in zip(pool.endpoints("decode"), (0.2, 0.6), strict=True):
        ep.load = EngineLoad(0.0, 4.0, usage, clock.t)
    # 6000 queued tokens over 2 x 1000 tokens/s: 3 s; D's mean KV usage 0.4.
    assert decider.pressure() == (pytest.approx(3.0), pytest.approx(0.4))
    # P wants 2 x 3 / 1 = 6 engines' worth, D 2 x 0.4 / 0.8 = 1: six P per D.
    assert decider.recommended_ratio() == pytest.approx(6.0)
    assert registry.get_sample_value("pdgate_pd_pressure", {"role": "prefill"}) == \
        pytest.approx(3.0)
    assert registry.get_sample_value("pdgate_pd_pressure", {"role": "decode"}) == \
        pytest.approx(0.4)
    assert registry.get_sample_value("pdgate_pd_recommended_ratio") == pytest.approx(6.0)
