"""`session`: requests of one session go to the engine that served the session before.

The session key is the value of the header `header` or, when absent and `use_user` is set,
the request's OpenAI `user` field. A request without a key, or whose engine is gone or
unhealthy, goes to the least loaded candidate (ties rotate), which then becomes the
session's engine. The table is bounded: at most `max_sessions` keys (least recently used
dropped first), each forgotten `ttl_s` seconds after its last request.

| param          | default          | meaning                                        |
|----------------|------------------|------------------------------------------------|
| `header`       | `x-session-id`   | request header carrying the session key        |
| `use_user`     | true             | fall back to the body's `user` field           |
| `max_sessions` | 100000           | sessions remembered                            |
| `ttl_s`        | 600.0            | seconds a session is remembered after its use  |
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from pdgate.router.policies.base import ParamsType, PickContext, PolicyEnv, Scorer, least_loaded
from pdgate.router.pool import Endpoint

__all__ = ["Session", "SessionParams"]


class SessionParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    header: Annotated[str, Meta(min_length=1)] = "x-session-id"
    use_user: bool = True
    max_sessions: Annotated[int, Meta(ge=1)] = 100_000
    ttl_s: Annotated[float, Meta(gt=0)] = 600.0


class Session:
    """See the module docstring."""

    type: ClassVar[str] = "session"
    Params: ClassVar[ParamsType] = SessionParams
    scorers: Sequence[tuple[Scorer, float]] = ()

    def __init__(self, params: SessionParams, env: PolicyEnv) -> None:
        self.params = params
        self._clock = env.clock or time.monotonic
        # key -> (engine URL, expiry time); insertion order is last-use order.
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def key(self, ctx: PickContext) -> str | None:
        """The session key of a request, or None."""
        value = ctx.headers.get(self.params.header)
        if value:
            return value
        return ctx.user if self.params.use_user and ctx.user else None

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        key = self.key(ctx)
        now = self._clock()
        if key is not None and (found := self._sessions.get(key)) is not None:
            url, expires = found
            for ep in candidates:
                if ep.key == url and now < expires:
                    self._remember(key, url, now)
                    return ep
        ep = least_loaded(candidates, self._next)
        self._next += 1
        if key is not None:
            self._remember(key, ep.key, now)
        return ep

    def _remember(self, key: str, url: str, now: float) -> None:
        self._sessions[key] = (url, now + self.params.ttl_s)
        self._sessions.move_to_end(key)
        while self._sessions:
            oldest, (_, expires) = next(iter(self._sessions.items()))
            if len(self._sessions) <= self.params.max_sessions and expires > now:
                break
            del self._sessions[oldest]
