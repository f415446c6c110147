"""Per-leg endpoint selection policies: one Protocol, a read-only registry by type name.

Adding a policy: write a class with a kebab-case `type` and an async `pick`, then add it
to `_BUILTINS`. The runner `choose()` (not each policy) filters unhealthy and already-tried
endpoints and raises `NoEndpointAvailable`, so a policy only ever sees a non-empty list.

| type             | picks                                                          |
|------------------|----------------------------------------------------------------|
| `round-robin`    | the next candidate in turn                                     |
| `least-inflight` | the candidate with the fewest requests in flight; ties rotate  |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Protocol

from router.errors import NoEndpointAvailable
from router.pool import Endpoint, EndpointPool, Role

__all__ = [
    "POLICIES",
    "LeastInflight",
    "PickContext",
    "Policy",
    "RoundRobin",
    "build_policy",
    "choose",
]


@dataclass(frozen=True, slots=True)
class PickContext:
    """What a policy may look at besides the endpoints. `prompt_token_ids` is None when the
    request was not tokenized as one prompt (batch prompts)."""

    request_id: str
    prompt_token_ids: Sequence[int] | None = None


class Policy(Protocol):
    """Chooses one endpoint of a role. Called on the event loop once per leg attempt."""

    type: ClassVar[str]

    async def pick(self, candidates: Sequence[Endpoint], ctx: PickContext) -> Endpoint:
        """Return one of `candidates` (never empty, all healthy). Must not block."""
        ...


class RoundRobin:
    """Cycles through the candidates in order."""

    type: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    async def pick(self, candidates: Sequence[Endpoint], ctx: PickContext) -> Endpoint:
        ep = candidates[self._next % len(candidates)]
        self._next += 1
        return ep


class LeastInflight:
    """Picks the candidate with the fewest in-flight requests; among equals, rotates (one
    counter over the tied set) so a quiet pool still spreads load instead of hammering the
    first endpoint."""

    type: ClassVar[str] = "least-inflight"

    def __init__(self) -> None:
        self._next = 0

    async def pick(self, candidates: Sequence[Endpoint], ctx: PickContext) -> Endpoint:
        least = min(ep.in_flight for ep in candidates)
        tied = [ep for ep in candidates if ep.in_flight == least]
        ep = tied[self._next % len(tied)]
        self._next += 1
        return ep


_BUILTINS: tuple[type[Policy], ...] = (
    RoundRobin,
    LeastInflight,
)

POLICIES: MappingProxyType[str, type[Policy]] = MappingProxyType(
    {cls.type: cls for cls in _BUILTINS}
)
"""Registered policy classes by `type` name (read-only)."""


def build_policy(name: str) -> Policy:
    """A fresh instance of the policy registered as `name` (KeyError names the known ones)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})") from None
    return cls()


async def choose(
    pool: EndpointPool,
    role: Role,
    policy: Policy,
    ctx: PickContext,
    exclude: Sequence[Endpoint] = (),
) -> Endpoint:
    """Pick a healthy `role` endpoint not in `exclude` (the engines already tried).

    Raises `NoEndpointAvailable` when no such endpoint exists.
    """
    candidates = pool.healthy(role)
    if exclude:
        candidates = [ep for ep in candidates if ep not in exclude]
    if not candidates:
        raise NoEndpointAvailable(f"no healthy {role} engine available")
    return await policy.pick(candidates, ctx)
