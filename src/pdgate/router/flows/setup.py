"""Builds the flows in the app's lifespan: pull always (it also serves decode-only
requests, and is the fallback of notify and push inside the flow layer), and the notify or
push flow of each model's `pd_mode`, with the KV-ready proxy notify needs. Several models
share one `FlowShared`: the flow metrics and the one KV-ready proxy of the router."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from pdgate.proxy import NotifyServer, ProxyConfig, ProxyMetrics
from pdgate.router.config import RouterConfig
from pdgate.router.flows.base import Flow, FlowParts
from pdgate.router.flows.common import FlowMetrics, KVInfoCache
from pdgate.router.flows.early import FirstTokenCheck, TokenText
from pdgate.router.flows.migration import MigrationMetrics
from pdgate.router.flows.notify import NotifyFlow
from pdgate.router.flows.pull import PullFlow
from pdgate.router.flows.push import PushFlow

__all__ = ["FlowShared", "open_flows"]


class FlowShared:
    """What the flows of every model share: their metrics (registered once on the app's
    registry) and the KV-ready proxy, started by the first notify-mode model and stopped by
    `stack` (its settings are the router's, not a model's)."""

    def __init__(self, config: RouterConfig, registry: CollectorRegistry,
                 stack: contextlib.AsyncExitStack) -> None:
        self.metrics = FlowMetrics.create(registry)
        self.migration = MigrationMetrics.create(registry)  # router/flows/migration.py
        self._config, self._registry, self._stack = config, registry, stack
        self._proxy: NotifyServer | None = None

    async def proxy(self) -> NotifyServer:
        """The router's KV-ready proxy, started on first use."""
        if self._proxy is None:
            c = self._config
            proxy = NotifyServer(
                ProxyConfig(bind=c.notify_bind, advertise_host=c.notify_advertise_host,
                            notify_secret=c.notify_secret, ttl_s=c.notify_ttl_s,
                            reap_interval_s=c.notify_reap_interval_s),
                metrics=ProxyMetrics.create(self._registry),
            )
            await proxy.start()
            self._stack.push_async_callback(proxy.close)
            self._proxy = proxy
        return self._proxy


async def open_flows(
    config: RouterConfig, parts: FlowParts, shared: FlowShared,
    tokenizer: TokenText | None = None,
) -> tuple[PullFlow, Flow]:
    """The pull flow and the flow of `config.pd_mode` (the same object in pull and
    colocated mode). `tokenizer` (when the model has one) checks P's early first tokens;
    every engine answer refused for answering another request is counted."""
    metrics = shared.metrics
    m = parts.metrics

    def refused(reason: str) -> None:
        m.child(m.engine_answers_refused, reason).inc()

    def withheld(reason: str) -> None:
        metrics.early_withheld.labels(reason).inc()

    parts.engines.set_refusal_listener(refused)
    early = FirstTokenCheck(tokenizer, refused, withheld) if config.early_first_token else None
    pull = PullFlow(parts, metrics, early)
    if config.pd_mode in ("pull", "colocated"):
        return pull, pull
    if config.pd_mode == "push":
        return pull, PushFlow(parts, metrics, KVInfoCache(parts.engines), pull.decode,
                              pull.fallback, early=early, kv_wait_s=config.kv_ready_timeout_s)
    return pull, NotifyFlow(parts, await shared.proxy(), metrics, config.kv_ready_timeout_s,
                            pull.fallback, early=early)
