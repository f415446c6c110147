"""What every flow shares: the parts it runs on, its interface, and a streaming answer."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from pdgate.router.aborts import Aborter
from pdgate.router.engines.client import EngineClient
from pdgate.router.input.schema import ClientRequest
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import Selector
from pdgate.router.pool import EndpointPool, Role

__all__ = ["Fallback", "Flow", "FlowParts", "StreamResult"]


@dataclass(frozen=True, slots=True)
class FlowParts:
    """The app's engines, pool, policies and metrics, built once in the lifespan and handed
    to every flow; `max_retries` and `retry_backoff_s` bound the one retry loop
    (router/flows/failover.py), `aborter` sends every flow's best-effort KV aborts."""

    pool: EndpointPool
    engines: EngineClient
    policies: dict[Role, Selector]
    metrics: RouterMetrics
    aborter: Aborter
    max_retries: int = 1
    retry_backoff_s: float = 0.02


@dataclass(slots=True)
class StreamResult:
    """A streaming answer: iterate `chunks`, then always call `close()` (idempotent),
    even when `chunks` was never started."""

    chunks: AsyncGenerator[bytes, None]
    close: Callable[[], None]


class Flow(Protocol):
    """One `--pd-mode`: serves a request the decider chose to disaggregate."""

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        """JSON body bytes or a `StreamResult`. A request this mode cannot run here is
        served by the flow's fallback (the pull flow), inside the flow layer."""
        ...


Fallback = Callable[[ClientRequest, float, bool], Awaitable[bytes | StreamResult]]
"""How a notify/push flow serves a request its mode cannot run here: the pull flow's
`fallback(req, t0, decode_alone)`: its `run` (which serves the request on a decode engine
alone when no prefill engine is up), or with `decode_alone` a decode engine at once (every
prefill engine was unreachable for this request: the pull flow would only ask them again)."""
