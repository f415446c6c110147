"""The router's OpenTelemetry tracing (common/tracing.py does the work): one SERVER span per
client request, child of the client's `traceparent` and parent of the engines' spans (the
request's `traceparent` is rewritten to this span before the API forwards it on both legs).

At the end the span gets what the request's record learned (router/request_context.py):
request ids, model, mode, fallback, TTFT, admission wait, tokens and the engines chosen.
For spans inside a flow: `with span("prefill_leg"):` (router.tracing.span; a no-op when
the request is not traced).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio.to_thread

from pdgate.common import tracing as common
from pdgate.common.tracing import (
    Tracing,
    TracingMiddleware,
    TracingUnavailable,
    check_available,
    record_span,
    request_span,
    tracing_requested,
)
from pdgate.router import __version__, request_context
from pdgate.router.config import RouterConfig

__all__ = ["UNTRACED", "Tracing", "TracingMiddleware", "TracingSlot", "check_tracing",
           "finish_span", "open_tracing", "record_span", "span"]

log = logging.getLogger("pdgate.router.tracing")

span = request_span  # `with span("prefill_leg", engine=url):` anywhere in a request

SERVICE = "pdgate-router"
# Probes and scrapes: a span every few seconds per kubelet and Prometheus, of no interest.
UNTRACED = frozenset({"/health", "/ready", "/metrics", "/dashboard/state"})


def check_tracing(config: RouterConfig, environ: Mapping[str, str]) -> bool:
    """Is tracing on? Asked for but unable to run (no SDK, a protocol not spoken), it is
    off and one warning says why: tracing never keeps a router from serving."""
    if not tracing_requested(config.otlp_traces_endpoint, environ):
        return False
    try:
        check_available(environ)
    except TracingUnavailable as exc:
        log.warning("%s; serving without tracing", exc)
        return False
    return True


def open_tracing(config: RouterConfig, environ: Mapping[str, str]) -> Tracing | None:
    """The router's tracer (None, with a warning, when it cannot be built; `shutdown()` at
    exit)."""
    return common.open_tracing(SERVICE, config.otlp_traces_endpoint, environ,
                               {"service.version": __version__})


def finish_span(span: Any, status: int) -> None:
    """Copy the request's record onto its span (None fields left out)."""
    record = request_context.current()
    if record is None:
        return
    values = {
        "pdgate.request_id": record.request_id,
        "pdgate.client_request_id": record.client_request_id,
        "gen_ai.request.model": record.model,
        "pdgate.mode": record.mode,
        "pdgate.fallback": record.fallback,
        "pdgate.ttft_s": record.ttft_s,
        "pdgate.admission_wait_s": record.admission_wait_s,
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "pdgate.prefill_engine": record.engines.get("prefill"),
        "pdgate.decode_engine": record.engines.get("decode"),
    }
    for key, value in values.items():
        if value is not None:
            span.set_attribute(key, value)


class TracingSlot:
    """The app's tracer while it serves: `running()` (in the lifespan) builds it and flushes
    it at the end; `get()` is what the middleware asks each request (None: untraced).
    Checked at once: asked for without the SDK, `enabled` is False after one warning."""

    def __init__(self, config: RouterConfig, environ: Mapping[str, str]) -> None:
        self.enabled = check_tracing(config, environ)
        self._config = config
        self._environ = environ
        self._tracing: Tracing | None = None

    def get(self) -> Tracing | None:
        return self._tracing

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        if not self.enabled:
            yield
            return
        self._tracing = open_tracing(self._config, self._environ)
        try:
            yield
        finally:
            tracing, self._tracing = self._tracing, None
            if tracing is not None:
                await anyio.to_thread.run_sync(tracing.shutdown)  # a last export
