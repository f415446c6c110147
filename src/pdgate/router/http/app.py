"""The router app factory: everything is built here or in the lifespan and passed in, no globals.

`create_app(config)` validates the config at once (bad settings fail before serving);
each model's tokenizer is loaded there too, only if something configured for that model
reads prompt tokens (router/input/tokenizer_setup.py). The lifespan then builds, in order,
metrics → engine client (one pool of keep-alive connections, shared by every model) → each
model's endpoint pool (first health round, all models at once) → per model: discovery,
health-check task, routing, flows, orchestrator (router/served_models.py) — and tears them
down in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.middleware.cors import CORSMiddleware

from pdgate.router.aborts import Aborter
from pdgate.router.adapters import AdapterRegistry, ModelAdapters, parse_adapter_sources
from pdgate.router.admission import Admission
from pdgate.router.config import RouterConfig
from pdgate.router.config_checks import model_configs, validate_config
from pdgate.router.discovery import KubernetesDiscovery
from pdgate.router.dp_learn import open_dp_learning
from pdgate.router.engine_cards import EngineCards
from pdgate.router.engine_load import load_interval_s, open_load_polling
from pdgate.router.engines.client import EngineClient
from pdgate.router.errors import RouterError
from pdgate.router.flows.base import FlowParts
from pdgate.router.flows.setup import FlowShared, open_flows
from pdgate.router.health import HealthSettings
from pdgate.router.http.access_log import AccessLogMiddleware
from pdgate.router.http.admin import install_admin_routes
from pdgate.router.http.api import RouterState, StateHolder, install_routes
from pdgate.router.http.auth import AuthMiddleware
from pdgate.router.http.dashboard import install_dashboard
from pdgate.router.http.drain import Drain
from pdgate.router.http.passthrough import install_passthrough
from pdgate.router.http.routes import RouterApp, RouteTable
from pdgate.router.input.limits import InputLimits
from pdgate.router.input.tokenization import PromptTokenizer
from pdgate.router.input.tokenizer_setup import (
    log_no_tokenizer,
    open_migration_tokenizer,
    open_tokenizer,
    token_readers,
)
from pdgate.router.metrics import RouterMetrics
from pdgate.router.orchestrator import MigrationSettings, Orchestrator
from pdgate.router.policies import POLICY_NAMES
from pdgate.router.policies.setup import check_routing, open_routing
from pdgate.router.pool import Endpoint, EndpointPool
from pdgate.router.priority import ClientKeys
from pdgate.router.quotas import TokenQuotas
from pdgate.router.served_models import ModelTable, ServedModel
from pdgate.router.tracing import UNTRACED, TracingMiddleware, TracingSlot, finish_span
from pdgate.router.worker_metrics import pod_registry, publish_forever, remove_published

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def create_app(
    config: RouterConfig,
    *,
    registry: CollectorRegistry | None = None,
    tokenizer: PromptTokenizer | None = None,
    tokenizers: Mapping[str, PromptTokenizer] | None = None,
    drain: Drain | None = None,
) -> RouterApp:
    """Build the router ASGI app for `config`.

    `registry`: where metrics go (default: a fresh registry per app, exposed at /metrics).
    `tokenizer`: a preloaded tokenizer for the first model (tests share one); `tokenizers`:
    preloaded ones by a model's `model` field. Default: each model loads its
    `tokenizer_source` here, when a feature configured for it reads prompt tokens.
    `drain`: the serving process's drain (router/http/drain.py), shown by `/ready`.
    Raises `ConfigError` for invalid settings or a needed tokenizer that cannot load.
    """
    validate_config(config, POLICY_NAMES)
    models: list[_ModelSetup] = []
    for i, one in enumerate(model_configs(config)):
        check_routing(one)
        readers = token_readers(one)
        given = (tokenizers or {}).get(one.model) or (tokenizer if i == 0 else None)
        tokenizer_ = given or open_tokenizer(one, readers) or open_migration_tokenizer(one)
        models.append(_ModelSetup(one, tokenizer_, bool(readers)))
    tracing = TracingSlot(config, os.environ)  # off unless configured (router/tracing.py)
    holder = StateHolder()
    # A --workers worker's scrape shows every worker of the pod (router/worker_metrics.py).
    registry = registry or pod_registry(os.environ) or RouterMetrics.registry()

    @contextlib.asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        async with tracing.running(), _serving_state(config, registry, models) as st:
            holder.set(st)
            log.info("serving on the %s event loop", _loop_name())
            sampler = asyncio.create_task(dashboard.sample_forever())  # its rate history
            publisher = asyncio.create_task(publish_forever(registry))
            try:
                yield
            finally:
                await _cancel(sampler)
                await _cancel(publisher)
                remove_published(registry)
                holder.set(None)

    # Every route the router serves is declared in this one table (router/http/routes.py);
    # each passes the same middlewares.
    table = RouteTable()
    install_routes(table, holder, drain)
    install_passthrough(table, holder)  # embeddings, tokenize, ...: one engine, no P/D
    dashboard = install_dashboard(table, holder)
    if config.admin_api_key:
        install_admin_routes(table, holder)
    return table.app(_middlewares(config, tracing), lifespan)


def _loop_name() -> str:
    """`uvloop` or `asyncio` (uvicorn picks uvloop when it is installed): benchmarks and
    operators should see which one served, since the router's CPU per request depends on it."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def _middlewares(config: RouterConfig, tracing: TracingSlot) -> list[tuple[Any, dict[str, Any]]]:
    """The router's pure-ASGI middlewares, innermost first: keys, CORS, tracing, access log
    (outermost: it sees 401s)."""
    found: list[tuple[Any, dict[str, Any]]] = []
    if config.client_api_keys or config.admin_api_key:
        found.append((AuthMiddleware, {"api_keys": config.client_api_keys,
                                       "admin_api_key": config.admin_api_key}))
    if config.cors_allowed_origins:  # outside the keys: browsers' preflights carry none
        found.append((CORSMiddleware, {
            "allow_origins": config.cors_allowed_origins, "allow_methods": ["GET", "POST"],
            "allow_headers": ["*"], "expose_headers": ["X-Request-Id", "Retry-After"]}))
    if tracing.enabled:
        found.append((TracingMiddleware, {"tracing": tracing.get, "finish": finish_span,
                                          "skip": UNTRACED}))
    found.append((AccessLogMiddleware, {"pd_mode": config.pd_mode}))
    return found


@dataclass(frozen=True)
class _ModelSetup:
    """One model as `create_app` prepared it: its config, its tokenizer (None: it needs
    none and none was given), and whether it reads prompt tokens."""

    config: RouterConfig
    tokenizer: PromptTokenizer | None
    tokenize_prompts: bool


@contextlib.asynccontextmanager
async def _serving_state(
    config: RouterConfig, registry: CollectorRegistry, models: list[_ModelSetup],
) -> AsyncIterator[RouterState]:
    # Several models: per-request and per-engine series get a `model` label (one model:
    # the series of a one-model router, unchanged).
    metrics = RouterMetrics.create(registry, by_model=len(models) > 1)
    limits = InputLimits.from_config(config)
    if not any(m.tokenize_prompts for m in models):
        log_no_tokenizer()
    async with contextlib.AsyncExitStack() as stack:
        engines = EngineClient.create(config)  # one connection pool for every model
        stack.push_async_callback(engines.close)

        adapters = AdapterRegistry(engines, load_timeout_s=config.lora_load_timeout_s) \
            if config.lora_on else None
        cards = EngineCards()

        async def probe(ep: Endpoint) -> bool:
            ok = await engines.health(ep.url)
            if not ok:
                cards.forget(ep.url)
            # Its models' cards once (router/engine_cards.py); with LoRA on, at each probe:
            # which adapters it holds, kept fresh.
            elif adapters is not None or not cards.knows(ep.url):
                listed = await engines.models(ep.url)
                if listed is not None:
                    cards.learn(ep.url, listed)
                    if adapters is not None:
                        adapters.learn(ep.url, listed)
            return ok

        views = [metrics.for_model(m.config.served_names[0]) for m in models]
        pools = [_pool(m.config, view) for m, view in zip(models, views, strict=True)]
        engines.set_stream_listener(_breaker_feed(pools))
        engines.set_discard_listener(
            lambda reason: metrics.child(metrics.engine_connections_discarded, reason).inc())
        await asyncio.gather(*(pool.check_all(probe) for pool in pools))
        aborter = Aborter(engines, metrics, config.kv_abort_timeout_s)
        stack.push_async_callback(aborter.aclose)  # waits for pending KV aborts, bounded
        shared = FlowShared(config, registry, stack)
        served = []
        for m, pool, view in zip(models, pools, views, strict=True):
            parts = _ModelParts(engines, view, aborter, shared, limits, probe, adapters,
                                cards)
            served.append(await _open_model(m, pool, parts, stack))
        table = ModelTable(served)
        first = table.default
        yield RouterState(config, metrics, registry, first.pool, first.orchestrator,
                          int(time.time()), table, _admission(config, metrics), limits,
                          ClientKeys(config), TokenQuotas())


def _pool(config: RouterConfig, metrics: RouterMetrics) -> EndpointPool:
    return EndpointPool(config.prefill, config.decode, metrics, health=HealthSettings(
        config.health_failure_threshold, config.health_success_threshold,
        config.eject_consecutive_errors, config.breaker_open_s,
    ), dp_size={"prefill": config.prefill_dp_size, "decode": config.decode_dp_size},
        decode_only=config.pd_mode == "colocated")


@dataclass(frozen=True)
class _ModelParts:
    """What every model's stack is built from: the router's shared parts."""

    engines: EngineClient
    metrics: RouterMetrics  # the model's view (`RouterMetrics.for_model`)
    aborter: Aborter
    shared: FlowShared
    limits: InputLimits
    probe: Callable[[Endpoint], Awaitable[bool]]
    adapters: AdapterRegistry | None  # LoRA adapters (None: enable_lora is off)
    cards: EngineCards  # the engines' /v1/models cards


async def _open_model(m: _ModelSetup, pool: EndpointPool, parts: _ModelParts,
                      stack: contextlib.AsyncExitStack) -> ServedModel:
    """One model's discovery, health checks, routing, flows and orchestrator; its tasks
    stop with `stack`."""
    config, tokenizer = m.config, m.tokenizer
    if tokenizer is not None:
        # This app's input limits (and max_model_len, also for a preloaded tokenizer).
        tokenizer = tokenizer.with_limits(parts.limits, config.max_model_len)
        stack.push_async_callback(tokenizer.aclose)  # client-template worker processes
    if config.discovery == "k8s":
        await _start_discovery(config, pool, stack)
    await open_dp_learning(config, pool, parts.engines.metrics_page, stack)  # DP size 0
    checker = asyncio.create_task(pool.run_health_checks(parts.probe,
                                                         config.health_interval_s))
    stack.push_async_callback(_cancel, checker)
    routing = await open_routing(config, pool, parts.metrics, stack)
    interval = load_interval_s(config.engine_load_interval_s, routing.reads_engine_load)
    if interval:
        await open_load_polling(pool, parts.engines.metrics_page, parts.metrics, interval,
                                stack)
    flow_parts = FlowParts(pool, parts.engines,
                           {"prefill": routing.prefill, "decode": routing.decode},
                           parts.metrics, parts.aborter, config.max_retries,
                           config.retry_backoff_s)
    pull, pd_flow = await open_flows(config, flow_parts, parts.shared, tokenizer)
    migration = MigrationSettings(parts.shared.migration, config.pd_mode,
                                  config.max_migrations, config.migration_deadline_s,
                                  config.migrate_non_streaming)
    orchestrator = Orchestrator(tokenizer, parts.metrics, pull, pd_flow, routing.decider,
                                tokenize_prompts=m.tokenize_prompts, limits=parts.limits,
                                migration=migration)
    adapters = None if parts.adapters is None else ModelAdapters(
        parts.adapters, pool, parts.metrics, load_on_demand=config.load_on_demand,
        sources=parse_adapter_sources(config.lora_adapters))
    return ServedModel(config, pool, orchestrator, adapters, parts.cards)


def _breaker_feed(pools: list[EndpointPool]) -> Callable[[str, RouterError | None], None]:
    """How each decode stream ended, fed to that engine's breaker: a stream that breaks
    after its first byte (reset, garbage, an overlong line) counts against its engine (in
    every model's pool that holds it: the engine is one process)."""

    def stream_ended(url: str, error: RouterError | None) -> None:
        for ep in (ep for pool in pools for ep in pool.endpoints("decode")):
            if ep.url == url:
                if error is None:
                    ep.health.record_success()
                else:
                    ep.health.record_failure()

    return stream_ended


def _admission(config: RouterConfig, metrics: RouterMetrics) -> Admission:
    def gauges(active: int, queued: int) -> None:
        metrics.admission_active.set(active)
        metrics.admission_queued.set(queued)

    return Admission(config.max_concurrent_requests, config.max_queued_requests,
                     config.queue_timeout_s, on_change=gauges,
                     on_wait=metrics.observe_admission_wait, order=config.admission_order,
                     reserved=config.reserved_slots)


async def _start_discovery(
    config: RouterConfig, pool: EndpointPool, stack: contextlib.AsyncExitStack
) -> None:
    # Serve even if the API server is slow: /ready answers 503 until engines show up.
    discovery = await KubernetesDiscovery.open(config, pool, os.environ)
    stack.push_async_callback(discovery.close)
    stack.push_async_callback(_cancel, asyncio.create_task(discovery.run()))
    if not await discovery.wait_synced(config.connect_timeout_s):
        log.warning("pod discovery has not listed the engines yet; serving anyway")


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
