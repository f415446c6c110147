"""Builds the flows in the app's lifespan: pull always (it also serves decode-only
requests and what notify/push hand back), and the notify or push flow of `--pd-mode`, with
the KV-ready proxy notify needs."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from pdgate.proxy import NotifyServer, ProxyConfig, ProxyMetrics
from pdgate.router.config import RouterConfig
from pdgate.router.flows.base import Flow, FlowParts
from pdgate.router.flows.common import FlowMetrics, KVInfoCache
from pdgate.router.flows.notify import NotifyFlow
from pdgate.router.flows.pull import PullFlow
from pdgate.router.flows.push import PushFlow

__all__ = ["open_flows"]


async def open_flows(
    config: RouterConfig, parts: FlowParts, registry: CollectorRegistry,
    stack: contextlib.AsyncExitStack,
) -> tuple[PullFlow, Flow]:
    """The pull flow and the flow of `config.pd_mode` (the same object in pull mode).
    Notify mode starts the KV-ready proxy (its metrics on `registry`); `stack` stops it."""
    metrics = FlowMetrics.create(registry)
    pull = PullFlow(parts, metrics, early_first_token=config.early_first_token)
    if config.pd_mode == "pull":
        return pull, pull
    if config.pd_mode == "push":
        return pull, PushFlow(parts, metrics, KVInfoCache(parts.engines), pull,
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
    return pull, NotifyFlow(parts, proxy, metrics, config.kv_ready_timeout_s,
                            early_first_token=config.early_first_token)
