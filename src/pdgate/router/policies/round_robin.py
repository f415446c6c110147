"""`round-robin`: the next candidate in turn; load is ignored. No params."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdgate.router.policies.base import NoParams, ParamsType, PickContext, PolicyEnv, Scorer
from pdgate.router.pool import Endpoint

__all__ = ["RoundRobin"]


class RoundRobin:
    """Cycles through the candidates in order."""

    type: ClassVar[str] = "round-robin"
    Params: ClassVar[ParamsType] = NoParams
    scorers: Sequence[tuple[Scorer, float]] = ()

    def __init__(self, params: NoParams, env: PolicyEnv) -> None:
        self._next = 0

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        ep = candidates[self._next % len(candidates)]
        self._next += 1
        return ep
