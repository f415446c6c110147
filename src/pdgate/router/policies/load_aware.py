"""`load-aware`: the engine with the least load, counting what the engine itself reports.

The router's own in-flight count misses the requests of other router replicas (and the
work an engine still does for requests the router gave up on); the engine's `/metrics`
(router/engine_load.py) does not. The `engine-load` scorer takes, per candidate,

    busy     = in flight + others running + waiting_weight * engine waiting

(`others running`: what the engine ran at its last read beyond this router's requests
then; this router's own count is taken as it is now, so a request that just ended does not
linger for a polling interval)
    score    = (1 - kv_weight) * (1 - min(1, busy / queue_threshold))
             + kv_weight * (1 - engine KV usage)

and falls back on the router's in-flight count alone (KV term at its best) where the
engine's figures are missing or older than `stale_s`. The picker takes the best score;
ties rotate (a quiet pool still spreads). Queued requests weigh more than running ones:
they wait for a whole batch slot, where a running one shares the step.

| param             | default | meaning                                                 |
|-------------------|---------|---------------------------------------------------------|
| `queue_threshold` | 32      | `busy` at which the queue term reaches 0                |
| `waiting_weight`  | 2.0     | weight of a queued (not yet running) request            |
| `kv_weight`       | 0.3     | share of the score given to free KV cache, 0..1         |
| `stale_s`         | 5.0     | engine figures older than this are ignored (seconds)    |
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from pdgate.router.policies.base import ParamsType, PickContext, PolicyEnv, Scorer
from pdgate.router.pool import Endpoint

__all__ = ["EngineLoadScorer", "LoadAware", "LoadAwareParams"]


class LoadAwareParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    queue_threshold: Annotated[float, Meta(gt=0.0)] = 32.0
    waiting_weight: Annotated[float, Meta(ge=0.0)] = 2.0
    kv_weight: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.3
    stale_s: Annotated[float, Meta(gt=0.0)] = 5.0


class EngineLoadScorer:
    """The `engine-load` score of the module docstring, in [0, 1]."""

    name: ClassVar[str] = "engine-load"
    needs_tokens: ClassVar[bool] = False
    reads_text: ClassVar[bool] = False
    reads_engine_load: ClassVar[bool] = True  # the app then polls engines' /metrics

    def __init__(self, params: LoadAwareParams, clock: Callable[[], float]) -> None:
        self._p = params
        self._clock = clock

    def score(self, candidates: Sequence[Endpoint], ctx: PickContext) -> list[float]:
        p = self._p
        now = self._clock()
        out = []
        for ep in candidates:
            load = ep.load
            if load is None or now - load.at > p.stale_s:
                busy, free_kv = float(ep.in_flight), 1.0
            else:
                busy = ep.in_flight + load.others_running + p.waiting_weight * load.waiting
                free_kv = 1.0 - load.kv_usage if load.kv_usage is not None else 1.0
            queue = 1.0 - min(1.0, busy / p.queue_threshold)
            out.append((1.0 - p.kv_weight) * queue + p.kv_weight * free_kv)
        return out


class LoadAware:
    """See the module docstring."""

    type: ClassVar[str] = "load-aware"
    Params: ClassVar[ParamsType] = LoadAwareParams

    def __init__(self, params: LoadAwareParams, env: PolicyEnv) -> None:
        self.params = params
        self._scorers: tuple[tuple[Scorer, float], ...] = (
            (EngineLoadScorer(params, env.clock or time.monotonic), 1.0),
        )
        self._next = 0

    @property
    def scorers(self) -> Sequence[tuple[Scorer, float]]:
        return self._scorers

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        turn, self._next = self._next, self._next + 1
        best = max(scores)
        tied = [ep for ep, s in zip(candidates, scores, strict=True) if s >= best - 1e-9]
        return tied[turn % len(tied)]
