"""`random`: a uniformly random candidate; load is ignored (vllm-router's `random`).

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

__all__ = ["RandomPick"]


class RandomParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seed: int | None = None  # for reproducible runs; None: fresh randomness


class RandomPick:
    """Picks any candidate with equal probability."""

    type: ClassVar[str] = "random"
    Params: ClassVar[ParamsType] = RandomParams
    scorers: Sequence[tuple[Scorer, float]] = ()

    def __init__(self, params: RandomParams, env: PolicyEnv) -> None:
        self._rng = random.Random(params.seed)

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        return candidates[self._rng.randrange(len(candidates))]
