"""The shim's OpenTelemetry tracing (proxy/tracing.py does the work): one SERVER span per
HTTP request, continuing the router's `traceparent`, so each engine leg hangs under the
router's request span. Off unless `--otlp-traces-endpoint` or the OTEL_* environment asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp

from engine_shim.logs import current_request_id
from proxy.tracing import Tracing, TracingMiddleware, tracing_requested

__all__ = ["open_tracing", "traced"]

SERVICE = "pdgate-shim"
_UNTRACED = frozenset({"/health", "/metrics"})


def open_tracing(endpoint: str | None, engine_id: str,
                 environ: Mapping[str, str]) -> Tracing | None:
    """The engine's tracer, or None when tracing is off. Raises `TracingUnavailable` when
    it is asked for without the OpenTelemetry SDK. Call `shutdown()` at exit."""
    if not tracing_requested(endpoint, environ):
        return None
    return Tracing(SERVICE, endpoint, {"service.instance.id": engine_id})


def traced(app: ASGIApp, tracing: Tracing | None) -> ASGIApp:
    """`app` with a span per request (itself when tracing is off). Wrap it inside
    `RequestIdMiddleware`, whose id the span carries."""
    if tracing is None:
        return app

    def finish(span: Any, status: int) -> None:
        if (request_id := current_request_id()) is not None:
            span.set_attribute("pdgate.request_id", request_id)

    return TracingMiddleware(app, lambda: tracing, finish=finish, skip=_UNTRACED)
