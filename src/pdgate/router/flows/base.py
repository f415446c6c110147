"""What every flow shares: the parts it runs on, its interface, and a streaming answer."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

from pdgate.router.aborts import Aborter
from pdgate.router.engines.client import EngineClient
from pdgate.router.input.schema import ClientRequest
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import Selector
from pdgate.router.pool import EndpointPool, Role

__all__ = ["Flow", "FlowParts", "StreamResult"]


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

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult | None:
        """JSON body bytes, a `StreamResult`, or None: "this request cannot run in this
        mode here; serve it with the pull flow" (the orchestrator does)."""
        ...
