"""The shim's OpenTelemetry tracing (common/tracing.py does the work): one SERVER span per
HTTP request, continuing the router's `traceparent`, so each engine leg hangs under the
router's request span. Off unless `--otlp-traces-endpoint` or the OTEL_* environment asks
(common/tracing.py: which variables are honoured; never an exit when it cannot run).

Inside a request: `tokenize` (server.py; a text prompt, or a chat rendered by its template,
to token ids), then in engine.py `queue` (admission: waiting for KV blocks), `await_reader`
(admitted -> the first read of the stream, which starts the work; `pdgate.waited_for`:
`response_head` when the SSE status and headers go out first, `collector_task` for a JSON
answer), `kv_transfer` (D: the prompt's KV from P; mode pull = READ, notify/push = P's WRITE
landing; bytes, descriptors = blocks, peer), `prefill` (submitted to the loop -> first
token) and `decode` (first token -> last), all children of the request's span. `span` opens
one; `annotate` adds attributes to the current one (e.g. the bytes once a transfer is done).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp

from pdgate.common import tracing as common
from pdgate.common.tracing import Tracing, TracingMiddleware, record_span, request_span
from pdgate.engine_shim.logs import current_request_id

__all__ = ["annotate", "open_tracing", "record_span", "span", "traced"]

span = request_span  # `with span("kv_transfer", **attributes):` (a no-op untraced)

SERVICE = "pdgate-shim"
_UNTRACED = frozenset({"/health", "/metrics"})


def open_tracing(endpoint: str | None, engine_id: str,
                 environ: Mapping[str, str]) -> Tracing | None:
    """The engine's tracer, or None when tracing is off or cannot run here (asked for
    without the OpenTelemetry SDK: one warning, and the engine serves untraced). Call
    `shutdown()` at exit."""
    return common.open_tracing(SERVICE, endpoint, environ, {"service.instance.id": engine_id})


def traced(app: ASGIApp, tracing: Tracing | None) -> ASGIApp:
    """`app` with a span per request (itself when tracing is off). Wrap it inside
    `RequestIdMiddleware`, whose id the span carries."""
    if tracing is None:
        return app

    def finish(span: Any, status: int) -> None:
        if (request_id := current_request_id()) is not None:
            span.set_attribute("pdgate.request_id", request_id)

    return TracingMiddleware(app, lambda: tracing, finish=finish, skip=_UNTRACED)


def annotate(**attributes: Any) -> None:
    """Set attributes (None values left out) on the current span; a no-op when it is not
    recording (tracing off, or code outside a request such as the engine loop)."""
    try:
        from opentelemetry import trace
    except ImportError:  # the otel extra is not installed: nothing is traced
        return
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes({k: v for k, v in attributes.items() if v is not None})
