"""The router app factory: everything is built in the lifespan and passed in, no globals.

`create_app(config)` validates the config at once (bad settings fail before serving);
the lifespan then builds, in order, metrics → tokenizer → engine client (one pooled
aiohttp session) → endpoint pool (first health round) → health-check task → orchestrator,
and tears them down in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import anyio.to_thread
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from router.api import RouterState, StateHolder, install_error_handlers, install_routes
from router.config import RouterConfig, validate_config
from router.engines import EngineClient
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.policies import POLICIES, build_policy
from router.pool import Endpoint, EndpointPool
from router.tokenization import PromptTokenizer, load_tokenizer

__all__ = ["create_app"]


def create_app(
    config: RouterConfig,
    *,
    registry: CollectorRegistry | None = None,
    tokenizer: PromptTokenizer | None = None,
) -> FastAPI:
    """Build the router ASGI app for `config`.

    `registry`: where metrics go (default: a fresh registry per app, exposed at /metrics).
    `tokenizer`: a preloaded tokenizer (tests share one); default loads
    `config.tokenizer_source` at startup. Raises `ConfigError` for invalid settings.
    """
    validate_config(config, frozenset(POLICIES))
    holder = StateHolder()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _serving_state(config, registry or CollectorRegistry(), tokenizer) as st:
            holder.set(st)
            try:
                yield
            finally:
                holder.set(None)

    app = FastAPI(
        title="pdgate router", lifespan=lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )
    install_routes(app, holder)
    install_error_handlers(app)
    return app


@contextlib.asynccontextmanager
async def _serving_state(
    config: RouterConfig, registry: CollectorRegistry, tokenizer: PromptTokenizer | None
) -> AsyncIterator[RouterState]:
    metrics = RouterMetrics.create(registry)
    if tokenizer is None:
        tokenizer = await anyio.to_thread.run_sync(
            load_tokenizer, config.tokenizer_source, config.model, config.max_model_len
        )
    async with contextlib.AsyncExitStack() as stack:
        engines = EngineClient.create(config)
        stack.push_async_callback(engines.close)
        pool = EndpointPool(config.prefill, config.decode, metrics)

        async def probe(ep: Endpoint) -> bool:
            return await engines.health(ep.url)

        await pool.check_all(probe)
        checker = asyncio.create_task(pool.run_health_checks(probe, config.health_interval_s))
        stack.push_async_callback(_cancel, checker)
        orchestrator = Orchestrator(
            pool, engines, build_policy(config.prefill_policy),
            build_policy(config.decode_policy), tokenizer, metrics,
        )
        yield RouterState(config, metrics, registry, pool, orchestrator, int(time.time()))


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
