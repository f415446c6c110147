"""`measured-cost`: disaggregate a request when "P then D" is predicted to give its first
token sooner than "D alone", from what the router measures.

The static rules stay first and act as bounds an operator sets (router/policies/decider.py:
`n_gt_1`, `batch_prompt`, `prompt_logprobs`, `short_prompt` below `--disagg-min-tokens`,
`decode_has_prefix`), then `long_prompt`: prompts over `max_direct_tokens` always
disaggregate. Otherwise the predictor (router/policies/cost_model.py) compares the two
times to first token over the healthy engines, with each engine's queue:

- on a P: the prompt tokens of requests this router sent there that are still in their P
  leg, less what the engine has computed of the earliest of them (its rate times the time
  since it was sent or since the engine's previous prompt finished, at most 90 % of it),
  plus what the engine's `/metrics` shows beyond them (other routers' requests, times the
  mean prompt length);
- on a D: the prompt tokens of direct requests still waiting for their first token there
  (the earliest's computed part taken off, as on a P), its decode batch (one token each
  per step), and its queued requests.

The decision also picks the engine (`pick_engines`, on by default): the leg that computes
the prompt (P's in "P then D", D's in "D alone") goes to the engine with the least predicted
prefill time, engines within `margin` of it taken in turn; a P-then-D request's D leg, when
it is chosen, goes to the D with the least prompt work queued (a D about to compute a direct
prompt would stall the new stream). router/policies/runner.py takes the preferred engine
when it is eligible; the configured policy picks any leg whose engine is excluded (a
retry). So the prediction is for the engine that serves the request, and prompts
spread by the work queued on each engine, not by counts of requests (`least-inflight`
counts a 1,500-token prompt and a 48-token stream as one request each).

A request counts on its engine from the moment it is decided (picked) or its leg given to an
engine (the runner tells the request's watcher), not from its first byte back: a burst's
requests are decided before any leg has answered. Without `pick_engines`, one decided but
not yet given counts as an equal share on each engine of its role.

Reasons (the `reason` label of `pdgate_disagg_decisions_total`, and the access log's
`decision` field):

| reason             | disagg | when                                                        |
|--------------------|--------|-------------------------------------------------------------|
| `cost_disagg`      | yes    | P then D is predicted cheaper (or, within `margin`, held)   |
| `cost_direct`      | no     | D alone is predicted cheaper (or, within `margin`, held)    |
| `decode_itl_guard` | yes    | D alone would be cheaper, but its prefill would stall the   |
|                    |        | running decodes longer than `itl_stall_s` on every D        |
| `decode_stall_cost`| yes    | D alone would be cheaper by more than `margin` for this     |
|                    |        | request, but not once the delay its prefill adds to the     |
|                    |        | streams running on that D is counted (`stall_weight`)       |
| `long_prompt`      | yes    | more prompt tokens than `max_direct_tokens`                 |
| `probe`            | either | the mode the bucket does not hold, measured again (below)   |

Hysteresis: each prompt-length bucket holds a mode, which serves while the two predictions
are within `margin` of each other, so decisions do not flap on noise. A request whose other
mode is predicted cheaper by more than `margin` takes it (`pdgate_decider_overrides_total{to}`
counts those taken inside the dwell), and the held mode follows at most once per
`min_dwell_s` (`pdgate_decider_switches_total{to}`).

Probes: a mode the bucket does not hold is not measured, so its prediction would keep
whatever it last learnt (a cold engine's first request, a queue long gone) and the bucket
would never switch back. When a bucket's other mode has gone `probe_s` without a measurement
(counted from the bucket's first request), one request takes it (`probe`; the ITL guard
still applies), and what it measures corrects the prediction.

What each request measures (its P leg, its time to first token) teaches the predictor, and
the ratio measured / predicted is observed in `pdgate_decider_prediction_ratio{choice}`.
A non-streaming answer comes whole, its first token unseen (router/metrics.py
`served_whole`): such a request teaches its P leg only, counts in its D's queue until its
predicted time to first token has passed, and never probes D alone (nothing to measure).

| param               | default | meaning                                                |
|---------------------|---------|--------------------------------------------------------|
| `margin`            | 0.2     | how much cheaper the other mode must be (0.2: 20 %)    |
| `min_dwell_s`       | 1.0     | a bucket keeps a mode at least this long (seconds)     |
| `itl_stall_s`       | 1.0     | longest stall of a busy D's decodes that D alone may   |
|                     |         | cause, in seconds (0: no guard)                        |
| `stall_weight`      | 1.0     | what a second of stall to each running stream costs,   |
|                     |         | in seconds of the request's TTFT (0: not counted)      |
| `max_direct_tokens` | 0       | longer prompts always disaggregate (0: no bound)       |
| `probe_s`           | 10.0    | a mode unmeasured this long gets one request (0: never) |
| `alpha`             | 0.3     | weight of the newest measurement in each average       |
| `prior_tps`         | 2000    | prefill tokens/s assumed before anything was measured  |
| `stale_s`           | 5.0     | engine `/metrics` figures older than this are ignored  |
| `target_queue_s`    | 1.0     | prefill pressure the P pool is sized for (seconds)     |
| `target_kv_usage`   | 0.8     | decode pressure the D pool is sized for (KV fraction)  |
| `pick_engines`      | true    | the prompt's leg goes to the engine predicted fastest  |
|                     |         | (false: the configured policies pick every leg)        |

**Capacity signal** (read at each scrape; `pressure()`): `pdgate_pd_pressure{role="prefill"}`
is the prompt work queued on the healthy P engines over their measured throughput, in
seconds (Σ queued tokens / Σ prefill tokens/s at a queued prompt's typical length), and
`pdgate_pd_pressure{role="decode"}` the healthy D engines' mean KV usage from their
`/metrics` (their decode batches' memory: vLLM preempts at 1.0). `pdgate_pd_recommended_ratio`
is the P:D ratio (P engines per D engine) that would bring both to their targets:
(n_P x prefill / `target_queue_s`) / (n_D x decode / `target_kv_usage`), exported only when
both pools are under some pressure. An autoscaler scales each role on its own pressure
(the chart's `engines.autoscaling`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, ClassVar

import msgspec
from msgspec import Meta

from pdgate.router import request_context
from pdgate.router.input.schema import ClientRequest
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies.base import ParamsType
from pdgate.router.policies.cost_model import CostModel, Queue, bucket_of
from pdgate.router.policies.decider import Decision, PrefixDecider
from pdgate.router.policies.modes import Modes
from pdgate.router.pool import Endpoint, EndpointPool

if TYPE_CHECKING:
    from pdgate.router.engine_load import EngineLoad

__all__ = ["MeasuredCostDecider", "MeasuredCostParams"]


class MeasuredCostParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    margin: Annotated[float, Meta(ge=0.0)] = 0.2
    min_dwell_s: Annotated[float, Meta(ge=0.0)] = 1.0
    itl_stall_s: Annotated[float, Meta(ge=0.0)] = 1.0
    stall_weight: Annotated[float, Meta(ge=0.0)] = 1.0
    max_direct_tokens: Annotated[int, Meta(ge=0)] = 0
    probe_s: Annotated[float, Meta(ge=0.0)] = 10.0
    alpha: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.3
    prior_tps: Annotated[float, Meta(gt=0.0)] = 2000.0
    stale_s: Annotated[float, Meta(gt=0.0)] = 5.0
    target_queue_s: Annotated[float, Meta(gt=0.0)] = 1.0
    target_kv_usage: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.8
    pick_engines: bool = True


@dataclass(eq=False)
class _Pending:
    """One decided request until it ends: its queue snapshot and what it measured."""

    owner: MeasuredCostDecider
    req: ClientRequest
    n: int
    direct: bool
    t_decide: float
    arrival: float
    queues: dict[str, float]  # endpoint key -> queued tokens at the decision
    queue_n: int  # the typical queued prompt's length then (cost_model.Queue.prompt_n)
    predicted: dict[str, float]  # endpoint key -> predicted prefill seconds there
    overhead: float  # predicted seconds of a disaggregated request beyond its P leg
    prefer: dict[str, str]  # role -> the endpoint key predicted on (pick_engines)
    prefill_s: float | None = None
    first: bool = False
    sent_to: dict[str, str] = field(default_factory=dict)  # role -> endpoint key
    sent_at: float | None = None  # when the leg computing its prompt was given an engine

    @property
    def prompt_role(self) -> str:
        """The role of the leg that computes its prompt: D's alone, else P's."""
        return "decode" if self.direct else "prefill"

    def preferred(self, role: str) -> str | None:
        found = self.prefer.get(role)
        if found is None and role == "decode" and not self.direct and self.prefer:
            # P then D: its D leg is chosen when P is done (pull), so judged then
            return self.owner._quietest_decoder()
        return found

    def sent(self, role: str, key: str) -> None:
        self.sent_to[role] = key
        if role == self.prompt_role:
            self.sent_at = self.owner._clock()

    def waiting_on(self) -> tuple[str, str | None] | None:
        """(role, endpoint key or None while not yet sent) of the engine that still has
        this request's prompt to compute; None once that prefill is done (a non-streaming
        D alone: once its predicted time to first token has passed, none being seen)."""
        role = self.prompt_role
        if self.first if self.direct else self.prefill_s is not None:
            return None
        key = self.sent_to.get(role) or self.req.served_by.get(role) or self.prefer.get(role)
        if self.direct and not self.req.stream and key is not None and \
                self.owner._clock() - self.t_decide >= self.predicted.get(key, math.inf):
            return None
        return role, key

    def prefill_done(self, seconds: float) -> None:
        if self.prefill_s is None:
            self.prefill_s = seconds
            self.owner._learn_prefill(self, seconds)

    def first_token(self, ttft: float) -> None:
        if not self.first:
            self.first = True
            self.owner._learn_first(self, self.arrival + ttft - self.t_decide)

    def ended(self) -> None:
        self.owner._pending.pop(self.req.request_id, None)


class MeasuredCostDecider:
    """See the module docstring. Built once per app; `decide` runs on the event loop."""

    type: ClassVar[str] = "measured-cost"
    Params: ClassVar[ParamsType] = MeasuredCostParams
    reads_engine_load: ClassVar[bool] = True

    def __init__(self, params: MeasuredCostParams, static: PrefixDecider, pool: EndpointPool,
                 metrics: RouterMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 load_clock: Callable[[], float] = time.monotonic) -> None:
        self.params = params
        self.static = static
        self.pool = pool
        self.metrics = metrics
        self.model = CostModel(params.alpha, params.prior_tps)
        self.modes = Modes(params.margin, params.min_dwell_s)
        self._clock = clock
        self._load_clock = load_clock
        self._pending: dict[str, _Pending] = {}
        self._turn = 0  # rotates over engines predicted alike (`_engine`)
        self._done_at: dict[str, float] = {}  # endpoint key -> when a prompt last finished
        self._mean_n = 0.0  # mean prompt tokens of decided requests (EWMA)
        self._mean_n2 = 0.0  # mean of their square: _mean_n2 / _mean_n weighs by tokens
        # (bucket, direct) -> when that mode was last measured, or last probed (or, before
        # either, when the bucket was first decided: an idle router does not probe)
        self._measured: dict[tuple[int, bool], float] = {}
        if metrics is not None:
            self._publish(metrics)

    def _publish(self, m: RouterMetrics) -> None:
        """The capacity gauges, computed at each scrape (module docstring)."""
        m.labels(m.pd_pressure, "prefill").set_function(lambda: self.pressure()[0])
        m.labels(m.pd_pressure, "decode").set_function(lambda: self.pressure()[1] or 0.0)
        m.labels(m.pd_recommended_ratio).set_function(lambda: self.recommended_ratio() or 0.0)

    def pressure(self) -> tuple[float, float | None]:
        """(prefill seconds queued per P's throughput, decode mean KV usage or None when no
        D reported it) over the healthy engines."""
        prefill, decode = self.pool.healthy("prefill"), self.pool.healthy("decode")
        q = self.queues(prefill, ())
        n = max(1, self.queue_n)
        rates = sum(self.model.rate(ep.key, n) for ep in prefill)
        p = sum(q.values()) / rates if rates else 0.0
        now = self._load_clock()
        usages = [load.kv_usage for ep in decode
                  if (load := self._fresh(ep, now)) is not None and load.kv_usage is not None]
        return p, (sum(usages) / len(usages) if usages else None)

    def recommended_ratio(self) -> float | None:
        """P engines per D engine that would bring both pools to their targets (None
        while either pool shows no pressure)."""
        p, d = self.pressure()
        n_p, n_d = len(self.pool.healthy("prefill")), len(self.pool.healthy("decode"))
        if not p or not d or not n_p or not n_d:
            return None
        want_p = n_p * p / self.params.target_queue_s
        want_d = n_d * d / self.params.target_kv_usage
        return want_p / want_d

    @property
    def needs_tokens(self) -> bool:
        return True  # the prediction is per prompt length

    def decide(self, req: ClientRequest) -> Decision:
        base = self.static.decide(req)
        ids = req.prompt_token_ids
        if not base.disagg or ids is None:
            return base
        n = len(ids)
        self._mean_n += 0.1 * (n - self._mean_n) if self._mean_n else n
        self._mean_n2 += 0.1 * (n * n - self._mean_n2) if self._mean_n2 else n * n
        if self.params.max_direct_tokens and n > self.params.max_direct_tokens:
            return Decision(True, "long_prompt")
        prefill, decode = self.pool.healthy("prefill"), self.pool.healthy("decode")
        if not prefill or not decode:
            return base  # the flow serves it on D alone when no P is up
        queues = self.queues(prefill, decode)
        m = self.queue_n
        self._turn += 1
        t_p, _, p_key = self._engine(prefill, queues, n)
        t_pd = t_p + self.model.overhead(n)
        # D alone on a D where its prefill would not stall running streams, if there is one,
        # costed with the delay it adds to them; with no D within the bound the guard
        # decides (below), and the reason it counts is the bound, not the cost
        calm = [ep for ep in decode if not self._stalls_decodes(ep, n)]
        t_d, cost_d, d_key = self._engine(calm or decode, queues, n,
                                          self._stall_cost if calm else None)
        b = bucket_of(n)
        direct = self._mode(b, t_pd, cost_d)
        reason = "cost_direct" if direct else "cost_disagg"
        if not direct and t_d * (1 + self.params.margin) < t_pd:
            reason = "decode_stall_cost"  # only the stalled streams' delay kept it off D
        # D alone measures only a first token, which a non-streaming answer does not show
        if (direct or req.stream) and self._probe_due(b, not direct):
            direct, reason = not direct, "probe"
        if direct and not calm:
            direct, reason = False, "decode_itl_guard"
        key = d_key if direct else p_key
        prefer = {"decode" if direct else "prefill": key} \
            if key is not None and self.params.pick_engines else {}
        self._watch(req, n, direct, queues, m, t_d if direct else t_pd, prefer)
        return Decision(not direct, reason)

    def _engine(self, engines: Sequence[Endpoint], queues: dict[str, float], n: int,
                extra: Callable[[Endpoint, int], float] | None = None
                ) -> tuple[float, float, str | None]:
        """(predicted prefill seconds, cost, key) of the one of `engines` a prompt of `n`
        tokens would go to, behind `queues`: the least cost (the predicted time plus
        `extra`'s seconds), or any within `margin` of it, taken in turn. A per-engine rate is
        a noisy average, so an idle pool's engines never predict exactly alike, and the
        least alone would send every prompt of a quiet pool to whichever measured fastest
        last; within the margin they are equals and share the work (round robin)."""
        if not engines:
            return math.inf, math.inf, None
        m = self.queue_n
        times = [self.model.prefill_s(Queue(ep.key, queues[ep.key], m), n) for ep in engines]
        costs = [t + extra(ep, n) if extra is not None else t
                 for t, ep in zip(times, engines, strict=True)]
        bound = min(costs) * (1 + self.params.margin)
        near = [i for i, c in enumerate(costs) if c <= bound]
        i = near[self._turn % len(near)]
        return times[i], costs[i], engines[i].key

    def _quietest_decoder(self) -> str | None:
        """The D a disaggregated request's decode leg should take: the least prompt work
        queued there (direct prompts not yet computed, then its decode batch), engines
        within `margin` of it in turn. A D about to compute a long prompt would stall the
        new stream's first steps behind it; the running batch alone is what
        `least-inflight` counts."""
        decode = self.pool.healthy("decode")
        self._turn += 1
        return self._engine(decode, self.queues((), decode), 0)[2]

    def _probe_due(self, bucket: int, direct: bool) -> bool:
        """Whether bucket's mode `direct` went `probe_s` unmeasured (and unprobed): if so,
        it is marked probed now."""
        every = self.params.probe_s
        now = self._clock()
        if not every or now - self._measured.setdefault((bucket, direct), now) < every:
            return False
        self._measured[(bucket, direct)] = now
        return True

    def _predict_all(self, queues: dict[str, float], n: int, m: int) -> dict[str, float]:
        return {k: self.model.prefill_s(Queue(k, q, m), n) for k, q in queues.items()}

    @property
    def queue_n(self) -> int:
        """The typical length of a queued prompt: the token-weighted mean prompt length (a
        queue's tokens are mostly long prompts'); 0 before any request."""
        return round(self._mean_n2 / self._mean_n) if self._mean_n else 0

    def queues(self, prefill: Sequence[Endpoint], decode: Sequence[Endpoint]) -> dict[str, float]:
        """Queued prompt tokens per endpoint key (module docstring)."""
        mine: dict[str, float] = {}
        # Decided but not yet given to an engine (the leg's engine is chosen after the
        # decision): it will land on one of the role's engines, so each holds a share.
        unsent = {"prefill": 0.0, "decode": 0.0}
        heads: dict[str, tuple[float, _Pending]] = {}  # the earliest given prompt per engine
        for p in self._pending.values():
            at = p.waiting_on()
            if at is None:
                continue
            role, key = at
            if key is None:
                unsent[role] += p.n
                continue
            mine[key] = mine.get(key, 0.0) + p.n
            if p.sent_at is not None and p.sent_at < heads.get(key, (math.inf, p))[0]:
                heads[key] = (p.sent_at, p)
        for key, (sent_at, head) in heads.items():
            mine[key] -= self._computed(key, sent_at, head.n)
        now = self._load_clock()
        out: dict[str, float] = {}
        share = unsent["prefill"] / len(prefill) if prefill else 0.0
        for ep in prefill:
            load = self._fresh(ep, now)
            extra = 0.0 if load is None else load.others_queued * self._mean_n
            out[ep.key] = mine.get(ep.key, 0.0) + extra + share
        share = unsent["decode"] / len(decode) if decode else 0.0
        for ep in decode:
            load = self._fresh(ep, now)
            batch = float(ep.in_flight) + (0.0 if load is None else load.others_running)
            waiting = 0.0 if load is None else load.waiting * self._mean_n
            out[ep.key] = mine.get(ep.key, 0.0) + batch + waiting + share
        return out

    def _computed(self, key: str, sent_at: float, n: int) -> float:
        """Tokens the engine `key` has computed by now of the earliest `n`-token prompt
        given to it (at `sent_at`) and not yet computed: its rate times the time since it
        was given or since the engine's previous prompt finished, whichever is later, at
        most 90 % of it (it has not answered). An engine works through its prompts first
        come first served, so the earliest is the one in progress; counted whole, a long
        prompt nearly done made the queue behind it look a prompt longer."""
        began = max(sent_at, self._done_at.get(key, -math.inf))
        elapsed = max(0.0, self._clock() - began)
        return min(0.9 * n, elapsed * self.model.rate(key, n))

    def _fresh(self, ep: Endpoint, now: float) -> EngineLoad | None:
        load = ep.load
        return load if load is not None and now - load.at <= self.params.stale_s else None

    def _mode(self, bucket: int, t_pd: float, t_d: float) -> bool:
        direct, switched = self.modes.choose(bucket, t_pd, t_d, self._clock())
        if self.metrics is not None and (switched or direct != self.modes.mode(bucket)):
            m = self.metrics
            family = m.decider_switches if switched else m.decider_overrides
            m.child(family, "direct" if direct else "disagg").inc()
        return direct

    def _stalls_decodes(self, ep: Endpoint, n: int) -> bool:
        """Whether D alone's prefill on `ep` would stall its running decodes too long."""
        limit = self.params.itl_stall_s
        if not limit:
            return False
        # Another router's decodes count as the engine last reported them; this router's
        # as they are now (a request of ours that just ended is no stall).
        busy = ep.in_flight > 0 or (ep.load is not None and ep.load.others_running > 0)
        return busy and n / self.model.rate(ep.key, n) > limit

    def _stall_cost(self, ep: Endpoint, n: int) -> float:
        """Seconds D alone on `ep` costs beyond the request's own TTFT: its prefill
        (`n / rate`) delays each request running there (this router's, and the others the
        engine last reported) by as much, weighed by `stall_weight`. Without it, D alone
        was taken whenever its own TTFT was sooner, however many streams it stalled, and
        the guard was the only protection: set low enough to keep long prompts away from
        the CPU bench's short streams (30 ms), it kept them off any D decoding anything,
        and a closed-loop burst queued on P as if there were no D (docs/benchmarks.md)."""
        weight = self.params.stall_weight
        if not weight:
            return 0.0
        others = ep.load.others_running if ep.load is not None else 0
        streams = ep.in_flight + others
        return weight * streams * n / self.model.rate(ep.key, n) if streams else 0.0

    def _watch(self, req: ClientRequest, n: int, direct: bool, queues: dict[str, float],
               queue_n: int, predicted: float, prefer: dict[str, str]) -> None:
        record = request_context.current()
        if record is None:
            return
        record.predicted_ttft_s = predicted
        pending = _Pending(self, req, n, direct, self._clock(), record.arrival, queues,
                           queue_n, self._predict_all(queues, n, queue_n),
                           self.model.overhead(n), prefer)
        self._pending[req.request_id] = pending
        record.watcher = pending

    def _learn_prefill(self, p: _Pending, seconds: float) -> None:
        key = p.req.served_by.get("prefill")
        if key is not None and not p.direct:
            self.model.learn_prefill(Queue(key, p.queues.get(key, 0.0), p.queue_n), p.n,
                                     seconds)
            self._measured[(bucket_of(p.n), False)] = self._done_at[key] = self._clock()

    def _learn_first(self, p: _Pending, seconds: float) -> None:
        key = p.req.served_by.get(p.prompt_role)
        if key is None:
            return
        q = Queue(key, p.queues.get(key, 0.0), p.queue_n)
        predicted = p.predicted.get(key, 0.0)
        if p.direct:
            self.model.learn_prefill(q, p.n, seconds)
            self._measured[(bucket_of(p.n), True)] = self._done_at[key] = self._clock()
        elif p.prefill_s is not None:
            predicted += p.overhead
            self.model.learn_overhead(p.n, seconds - p.prefill_s)
        else:
            return  # a disaggregated request served without its P leg (fallback)
        if self.metrics is not None and predicted > 0:
            m = self.metrics
            m.child(m.decider_prediction_ratio, "direct" if p.direct else "disagg").observe(
                seconds / predicted)
