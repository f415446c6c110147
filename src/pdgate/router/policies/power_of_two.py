"""`power-of-two`: the less loaded of two random candidates.

| param  | default | meaning                                        |
|--------|---------|------------------------------------------------|
| `seed` | None    | seeds the sampling (reproducible runs)         |
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from pdgate.router.policies.base import ParamsType, PickContext, PolicyEnv, Scorer
from pdgate.router.pool import Endpoint

__all__ = ["PowerOfTwo"]


class PowerOfTwoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seed: int | None = None  # for reproducible runs; None: fresh randomness


class PowerOfTwo:
    """Samples two distinct candidates and takes the one with fewer requests in flight
    (the first sampled on a tie): near least-loaded balance without herding every router
    replica onto the same idle engine."""

    type: ClassVar[str] = "power-of-two"
    Params: ClassVar[ParamsType] = PowerOfTwoParams
    scorers: Sequence[tuple[Scorer, float]] = ()

    def __init__(self, params: PowerOfTwoParams, env: PolicyEnv) -> None:
        self._rng = random.Random(params.seed)

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return b if b.in_flight < a.in_flight else a
