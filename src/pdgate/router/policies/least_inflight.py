"""`least-inflight`: the candidate with the fewest requests in flight; ties rotate.
No params."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdgate.router.policies.base import (
    NoParams,
    ParamsType,
    PickContext,
    PolicyEnv,
    Scorer,
    least_loaded,
)
from pdgate.router.pool import Endpoint

__all__ = ["LeastInflight"]


class LeastInflight:
    """Fewest in-flight requests; among equals, rotates (one counter over the tied set) so a
    quiet pool still spreads load instead of hammering the first endpoint."""

    type: ClassVar[str] = "least-inflight"
    Params: ClassVar[ParamsType] = NoParams
    scorers: Sequence[tuple[Scorer, float]] = ()

    def __init__(self, params: NoParams, env: PolicyEnv) -> None:
        self._next = 0

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        ep = least_loaded(candidates, self._next)
        self._next += 1
        return ep
