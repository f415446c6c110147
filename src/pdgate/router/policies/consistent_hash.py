"""`consistent-hash`: a session's requests go to one engine, the same on every router replica.

The key is the first of `headers` the request carries or, when none and `use_user` is set,
the OpenAI `user` field. It is placed on a hash ring of the healthy candidates
(`virtual_nodes` points per engine URL, as vllm-router's `consistent_hash`): the engine is
a function of the key and the set of engine URLs only, so router replicas agree without
sharing state, and when an engine leaves only its keys move (to the next engine on the
ring). The hash is BLAKE2b, not Python's per-process salted `hash()`. Requests without a
key go to the least loaded candidate (ties rotate).

| param           | default                       | meaning                            |
|-----------------|-------------------------------|------------------------------------|
| `headers`       | [`x-session-id`, `x-user-id`] | headers carrying the key, in order |
| `use_user`      | true                          | fall back to the body's `user`     |
| `virtual_nodes` | 160                           | ring points per engine             |
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from pdgate.router.policies.base import ParamsType, PickContext, PolicyEnv, Scorer, least_loaded
from pdgate.router.pool import Endpoint

__all__ = ["ConsistentHash", "ConsistentHashParams", "ring_point"]


class ConsistentHashParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    headers: Annotated[list[str], Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["x-session-id", "x-user-id"])
    use_user: bool = True
    virtual_nodes: Annotated[int, Meta(ge=1, le=10_000)] = 160


def ring_point(text: str) -> int:
    """A position on the ring: the same in every process and on every machine."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class _Ring:
    __slots__ = ("points", "urls")

    def __init__(self, urls: Sequence[str], virtual_nodes: int) -> None:
        pairs = sorted((ring_point(f"{url}#{i}"), url) for url in urls
                       for i in range(virtual_nodes))
        self.points = [p for p, _ in pairs]
        self.urls = [u for _, u in pairs]

    def owner(self, key: str) -> str:
        at = bisect.bisect(self.points, ring_point(key)) % len(self.points)
        return self.urls[at]


class ConsistentHash:
    """See the module docstring."""

    type: ClassVar[str] = "consistent-hash"
    Params: ClassVar[ParamsType] = ConsistentHashParams
    scorers: Sequence[tuple[Scorer, float]] = ()

    def __init__(self, params: ConsistentHashParams, env: PolicyEnv) -> None:
        self.params = params
        self._headers = [h.lower() for h in params.headers]
        # Rings by candidate set: the healthy set changes rarely, a ring costs
        # `virtual_nodes` hashes per engine to build.
        self._rings: dict[tuple[str, ...], _Ring] = {}
        self._next = 0

    def key(self, ctx: PickContext) -> str | None:
        """The routing key of a request, or None."""
        for name in self._headers:
            if value := ctx.headers.get(name):
                return value
        return ctx.user if self.params.use_user and ctx.user else None

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        key = self.key(ctx)
        if key is None:
            self._next += 1
            return least_loaded(candidates, self._next - 1)
        urls = tuple(sorted(ep.key for ep in candidates))
        ring = self._rings.get(urls)
        if ring is None:
            if len(self._rings) >= 64:  # engines churned: forget old sets
                self._rings.clear()
            ring = self._rings[urls] = _Ring(urls, self.params.virtual_nodes)
        owner = ring.owner(key)
        return next(ep for ep in candidates if ep.key == owner)
