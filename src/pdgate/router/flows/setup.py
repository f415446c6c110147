"""Builds the flows in the app's lifespan: pull always (it also serves decode-only
requests, and is the fallback of notify and push inside the flow layer), and the notify or
push flow of `--pd-mode`, with the KV-ready proxy notify needs."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from pdgate.proxy import NotifyServer, ProxyConfig, ProxyMetrics
from pdgate.router.config import RouterConfig
from pdgate.router.flows.base import Flow, FlowParts
from pdgate.router.flows.common import FlowMetrics, KVInfoCache
from pdgate.router.flows.early import FirstTokenCheck, TokenText
from pdgate.router.flows.notify import NotifyFlow
from pdgate.router.flows.pull import PullFlow
from pdgate.router.flows.push import PushFlow

__all__ = ["open_flows"]


async def open_flows(
    config: RouterConfig, parts: FlowParts, registry: CollectorRegistry,
    stack: contextlib.AsyncExitStack, tokenizer: TokenText | None = None,
) -> tuple[PullFlow, Flow]:
    """The pull flow and the flow of `config.pd_mode` (the same object in pull mode).
    Notify mode starts the KV-ready proxy (its metrics on `registry`); `stack` stops it.
    `tokenizer` (when the router has one) checks P's early first tokens; every engine
    answer refused for answering another request is counted."""
    metrics = FlowMetrics.create(registry)
    m = parts.metrics

    def refused(reason: str) -> None:
        m.child(m.engine_answers_refused, reason).inc()

    parts.engines.set_refusal_listener(refused)
    early = FirstTokenCheck(tokenizer, refused) if config.early_first_token else None
    pull = PullFlow(parts, metrics, early)
    if config.pd_mode == "pull":
        return pull, pull
    if config.pd_mode == "push":
        return pull, PushFlow(parts, metrics, KVInfoCache(parts.engines), pull.decode,
                              pull.run, early=early, kv_wait_s=config.kv_ready_timeout_s)
    proxy = NotifyServer(
        ProxyConfig(bind=config.notify_bind, advertise_host=config.notify_advertise_host,
                    notify_secret=config.notify_secret, ttl_s=config.notify_ttl_s,
                    reap_interval_s=config.notify_reap_interval_s),
        metrics=ProxyMetrics.create(registry),
    )
    await proxy.start()
    stack.push_async_callback(proxy.close)
    return pull, NotifyFlow(parts, proxy, metrics, config.kv_ready_timeout_s, pull.run,
                            early=early)
