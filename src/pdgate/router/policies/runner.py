"""The selection runner: candidates -> weighted scorers clamped to [0, 1] -> one picker.

`choose()` is what the orchestrator calls once per leg attempt. It filters the pool (healthy,
right role, not already tried, holding the request's LoRA adapter: router/adapters.py, which
also loads the adapter onto the chosen engine when none holds it), raises
`NoEndpointAvailable` when nothing is left, then hands
the rest to a `Selector` (one configured policy): the selector runs the policy's scorers,
clamps and weighs their outputs, lets the policy pick, times the whole selection, and
records the prompt's blocks on the chosen engine in the approximate prefix index (that
engine will hold them once it has served the request) plus the prefix hit metrics.

A request's watcher may name the engine a leg should take (`RequestWatcher.preferred`: the
measured-cost decider's least predicted time to the first token); when that engine is among
the eligible candidates it is taken instead of the policy's pick (and recorded the same
way), so the decision and the engine it was predicted on are one choice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdgate.router import request_context
from pdgate.router.errors import NoEndpointAvailable
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies.base import PickContext, Policy, PolicyEnv
from pdgate.router.pool import Endpoint, EndpointPool, Role
from pdgate.router.request_context import RequestWatcher
from pdgate.router.tracing import span

__all__ = ["Selector", "choose"]


class Selector:
    """One configured policy (`name` from its spec) with the runner's stages around it.
    Built once per leg at startup; used on the event loop only."""

    def __init__(
        self, policy: Policy, env: PolicyEnv, name: str, metrics: RouterMetrics | None = None
    ) -> None:
        self.policy = policy
        self.env = env
        self.name = name
        self.metrics = metrics
        self._reads_text = self.reads_text

    @property
    def type(self) -> str:
        return self.policy.type

    @property
    def needs_tokens(self) -> bool:
        """Whether this policy reads the prompt's tokens (one of its scorers does)."""
        return any(scorer.needs_tokens for scorer, _ in self.policy.scorers)

    async def select(
        self, role: Role, candidates: Sequence[Endpoint], ctx: PickContext
    ) -> Endpoint:
        """Score, pick and record one of `candidates` (non-empty, all eligible)."""
        t0 = time.perf_counter()
        scores = self.scores(candidates, ctx)
        ep = await self.policy.pick(candidates, scores, ctx)
        self.take(role, ep, ctx, t0)
        return ep

    def take(self, role: Role, ep: Endpoint, ctx: PickContext,
             t0: float | None = None) -> None:
        """Record `ep` as the leg's engine (prefix index, hit and duration metrics), picked
        by the policy since `t0` or preferred by the request's watcher."""
        self._record(role, ep, ctx)
        if self.metrics is not None and t0 is not None:
            m = self.metrics
            m.child(m.policy_duration, role).observe(time.perf_counter() - t0)

    def scores(self, candidates: Sequence[Endpoint], ctx: PickContext) -> list[float]:
        """Sum over the policy's scorers of weight x score clamped to [0, 1]."""
        totals = [0.0] * len(candidates)
        for scorer, weight in self.policy.scorers:
            values = scorer.score(candidates, ctx)
            for i, v in enumerate(values):
                totals[i] += weight * min(1.0, max(0.0, v))
        return totals

    @property
    def reads_engine_load(self) -> bool:
        """Whether a scorer reads the engines' own load (`Endpoint.load`): the app then
        polls their /metrics (router/engine_load.py). Scorers that do say so with a
        `reads_engine_load` class attribute; the others need not declare it."""
        return any(getattr(scorer, "reads_engine_load", False)
                   for scorer, _ in self.policy.scorers)

    @property
    def reads_text(self) -> bool:
        """Whether this policy routes on the prompt's text blocks (`prefix-text`)."""
        return any(scorer.reads_text for scorer, _ in self.policy.scorers)

    def _record(self, role: Role, ep: Endpoint, ctx: PickContext) -> None:
        hashes = ctx.text_hashes(self.env.block_chars) if self._reads_text \
            else ctx.block_hashes(self.env.block_size)
        if not hashes:
            return
        if self.metrics is not None:
            hit = self.env.matched_blocks(hashes, [ep.key], use_events=True).get(ep.key, 0)
            m = self.metrics
            m.child(m.prefix_lookup_blocks, role).inc(len(hashes))
            m.child(m.prefix_hit_blocks, role).inc(hit)
        self.env.approx.insert(ep.key, hashes)
        if not self._reads_text:  # `recent` bridges KV events, which carry token blocks
            self.env.recent.insert(ep.key, hashes)


async def choose(
    pool: EndpointPool,
    role: Role,
    selector: Selector,
    ctx: PickContext,
    exclude: Sequence[Endpoint] = (),
) -> Endpoint:
    """Pick a healthy `role` endpoint not in `exclude` (the engines already tried), and not
    one of `ctx.avoid`'s engines while another is left.

    Raises `NoEndpointAvailable` when no such endpoint exists.
    """
    candidates = pool.healthy(role)
    if exclude:
        candidates = [ep for ep in candidates if ep not in exclude]
    if ctx.avoid:
        candidates = [ep for ep in candidates if ep.url not in ctx.avoid] or candidates
    if not candidates:
        raise NoEndpointAvailable(f"no healthy {role} engine available")
    need = ctx.adapter
    if need is not None:  # a LoRA adapter: only engines holding it (or loading it)
        candidates = need.filter(role, candidates)
    record = request_context.current()
    watcher = None if record is None else record.watcher
    with span("choose_engine", **{"pdgate.role": role,
                                  "pdgate.candidates": len(candidates)}) as traced:
        ep = _preferred(watcher, role, candidates)
        if ep is None:
            ep = await selector.select(role, candidates, ctx)
        else:
            selector.take(role, ep, ctx)
        if traced is not None:
            traced.set_attribute("pdgate.engine", ep.key)
    if need is not None:
        await need.ensure(ep)
    if watcher is not None:
        watcher.sent(role, ep.key)
    return ep


def _preferred(watcher: RequestWatcher | None, role: Role,
               candidates: Sequence[Endpoint]) -> Endpoint | None:
    """The eligible candidate the request's watcher prefers for this leg, if any."""
    key = None if watcher is None else watcher.preferred(role)
    if key is None:
        return None
    return next((ep for ep in candidates if ep.key == key), None)
