"""Builds the `--pd-mode` flow in the app's lifespan: the KV-ready proxy (notify mode) and
the notify or push flow object the orchestrator hands disaggregated requests to."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from proxy import NotifyServer, ProxyConfig, ProxyMetrics
from router.config import RouterConfig
from router.flows.common import FlowMetrics, KVInfoCache
from router.flows.notify import NotifyFlow
from router.flows.push import PushFlow
from router.orchestrator import Orchestrator, PDFlow

__all__ = ["open_pd_flow"]


async def open_pd_flow(
    config: RouterConfig, orch: Orchestrator, registry: CollectorRegistry,
    stack: contextlib.AsyncExitStack,
) -> PDFlow | None:
    """The flow for `config.pd_mode` (None for pull, which the orchestrator runs itself).
    Notify mode starts the KV-ready proxy (its metrics on `registry`); `stack` stops it."""
    if config.pd_mode == "pull":
        return None
    metrics = FlowMetrics.create(registry)
    aborter = orch.aborter  # closed with the orchestrator
    if config.pd_mode == "push":
        return PushFlow(orch, metrics, aborter, KVInfoCache(orch.engines),
                        early_first_token=config.early_first_token,
                        kv_wait_s=config.kv_ready_timeout_s)
    proxy = NotifyServer(
        ProxyConfig(bind=config.notify_bind, advertise_host=config.notify_advertise_host,
                    notify_secret=config.notify_secret, ttl_s=config.notify_ttl_s,
                    reap_interval_s=config.notify_reap_interval_s),
        metrics=ProxyMetrics.create(registry),
    )
    await proxy.start()
    stack.push_async_callback(proxy.close)
    return NotifyFlow(orch, proxy, metrics, aborter, config.kv_ready_timeout_s,
                      early_first_token=config.early_first_token)
