"""`prefix-aware`: send a prompt where its longest prefix already is, unless load is skewed.

Scorers (weights are params): `prefix` (fraction of the prompt's full blocks the engine
holds, from the router's own index of past routing decisions), `load` (1 / (1 + in
flight)) and `spread` (fewer cached blocks is better, so new prefixes spread out). The
picker takes the best total, ties rotating. Before scoring, as in sglang's cache-aware
policy, the load is checked: when the most and least loaded candidates differ by more than
`balance_abs_threshold` requests *and* the most loaded has more than
`balance_rel_threshold` x the least, cache affinity is dropped for this request and the least
loaded candidate wins.

| param                   | default | meaning                                             |
|-------------------------|---------|-----------------------------------------------------|
| `prefix_weight`         | 1.0     | weight of the matched-prefix fraction               |
| `load_weight`           | 0.1     | weight of 1 / (1 + in flight)                       |
| `spread_weight`         | 0.01    | weight of "holds fewer cached blocks"               |
| `balance_abs_threshold` | 8       | in-flight difference that may count as imbalance    |
| `balance_rel_threshold` | 1.5     | max / min in-flight ratio that may count as one     |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from pdgate.router.policies.base import ParamsType, PickContext, PolicyEnv, Scorer, least_loaded
from pdgate.router.policies.scorers import LoadScorer, PrefixScorer, SpreadScorer
from pdgate.router.pool import Endpoint

__all__ = ["PrefixAware", "PrefixAwareParams"]

Weight = Annotated[float, Meta(ge=0.0)]


class PrefixAwareParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefix_weight: Weight = 1.0
    load_weight: Weight = 0.1
    spread_weight: Weight = 0.01
    balance_abs_threshold: Annotated[int, Meta(ge=0)] = 8
    balance_rel_threshold: Annotated[float, Meta(ge=1.0)] = 1.5


class PrefixAware:
    """See the module docstring."""

    type: ClassVar[str] = "prefix-aware"
    Params: ClassVar[ParamsType] = PrefixAwareParams
    use_events: ClassVar[bool] = False

    def __init__(self, params: PrefixAwareParams, env: PolicyEnv) -> None:
        self.params = params
        self._scorers: tuple[tuple[Scorer, float], ...] = (
            (PrefixScorer(env, use_events=self.use_events), params.prefix_weight),
            (LoadScorer(), params.load_weight),
            (SpreadScorer(env), params.spread_weight),
        )
        self._next = 0

    @property
    def scorers(self) -> Sequence[tuple[Scorer, float]]:
        return self._scorers

    def imbalanced(self, candidates: Sequence[Endpoint]) -> bool:
        """True when load is skewed enough to ignore cache affinity (both thresholds)."""
        loads = [ep.in_flight for ep in candidates]
        hi, lo = max(loads), min(loads)
        p = self.params
        return hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        turn, self._next = self._next, self._next + 1
        if self.imbalanced(candidates):
            return least_loaded(candidates, turn)
        best = max(scores)
        tied = [ep for ep, s in zip(candidates, scores, strict=True) if s >= best - 1e-12]
        return tied[turn % len(tied)]
