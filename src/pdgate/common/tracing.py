"""OpenTelemetry tracing shared by the router and the shim: setup, W3C propagation, and an
ASGI middleware that opens one SERVER span per HTTP request.

Off unless an OTLP/HTTP endpoint is given (`--otlp-traces-endpoint`) or the standard
environment asks for it (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT`; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
switch it off). When off, nothing of OpenTelemetry is imported. When on, the `otel` extra
(`pip install 'pdgate[otel]'`) must be installed. No global tracer provider is set: each
process builds its own `Tracing` and passes it where spans are made.

The middleware continues the caller's trace (`traceparent`/`tracestate`) and rewrites the
request's `traceparent` to its own span before the app sees it, so a router that forwards
`traceparent` on its engine legs makes the engines' spans children of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Tracing", "TracingMiddleware", "TracingUnavailable", "check_available",
           "record_span", "request_span", "tracing_requested"]

_OFF = ("true", "1", "yes")
# The tracer of the request being served (set by TracingMiddleware), so code deep in a
# request opens child spans with one line and no tracer passed down: `request_span(...)`.
_active: contextvars.ContextVar[Tracing | None] = contextvars.ContextVar(
    "pdgate_tracing", default=None)


def request_span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current request's span, or a no-op when the request is not
    traced: `with request_span("prefill_leg", engine=url): ...`."""
    tracing = _active.get()
    return contextlib.nullcontext() if tracing is None else tracing.span(name, **attributes)


def record_span(name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A finished child span of the current span, between two `time.time_ns()` instants,
    for work whose start and end lie in different frames (a stream's decode, across its
    yields: a current span there would outlive the frame). No-op when not traced."""
    tracing = _active.get()
    if tracing is None:
        return
    clean = {k: v for k, v in attributes.items() if v is not None}
    tracing.tracer.start_span(name, start_time=start_ns, attributes=clean).end(end_ns)


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the OpenTelemetry SDK is not installed."""


def tracing_requested(endpoint: str | None, environ: Mapping[str, str]) -> bool:
    """Does the flag or the standard OTEL_* environment turn tracing on?"""
    if environ.get("OTEL_SDK_DISABLED", "").lower() in _OFF:
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    return bool(endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def check_available() -> None:
    """Raise `TracingUnavailable` unless the OpenTelemetry SDK and exporter import."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(
            f"tracing is configured but OpenTelemetry is missing ({exc.name}): "
            "pip install 'pdgate[otel]'") from None


class Tracing:
    """One process' tracer, exporting over OTLP/HTTP in batches. `shutdown()` flushes."""

    def __init__(self, service: str, endpoint: str | None,
                 attributes: Mapping[str, str] | None = None) -> None:
        check_available()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        resource = Resource.create({"service.name": service, **(attributes or {})})
        self._provider = TracerProvider(resource=resource)
        # The endpoint flag wins; without it the exporter reads the OTEL_* environment.
        exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("pdgate")
        self._propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Any]:
        """A child span of the current one (INTERNAL), current while the block runs.
        Attributes whose value is None are left out."""
        clean = {k: v for k, v in attributes.items() if v is not None}
        with self.tracer.start_as_current_span(name, attributes=clean) as span:
            yield span

    def inject(self, headers: dict[str, str]) -> None:
        """Write the current span's `traceparent` (and `tracestate`) into `headers`."""
        self._propagator.inject(headers)

    def extract(self, headers: Mapping[str, str]) -> Any:
        """The remote parent context carried by `headers` (empty when none)."""
        return self._propagator.extract(dict(headers))

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter thread."""
        self._provider.shutdown()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class TracingMiddleware:
    """Pure ASGI: one SERVER span per HTTP request, named `METHOD path`, child of the
    caller's trace. `tracing()` gives the process' `Tracing` (None: not started yet, or
    off: the request passes untraced); `finish(span, status)` (optional) adds attributes
    at the end; paths in `skip` (probes, scrapes) are not traced."""

    def __init__(self, app: ASGIApp, tracing: Callable[[], Tracing | None],
                 finish: Callable[[Any, int], None] | None = None,
                 skip: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.get_tracing = tracing
        self.finish = finish
        self.skip = skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracing = self.get_tracing()
        if tracing is None or scope["type"] != "http" or scope["path"] in self.skip:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {k: v for k in ("traceparent", "tracestate")
                   if (v := _header(scope, k.encode())) is not None}
        parent = tracing.extract(carrier)
        status = 500
        with tracing.tracer.start_as_current_span(
            f"{scope['method']} {scope['path']}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        ) as span:
            own: dict[str, str] = {}
            tracing.inject(own)
            headers = [(k, v) for k, v in scope["headers"]
                       if k not in (b"traceparent", b"tracestate")]
            headers += [(k.encode(), v.encode("latin-1")) for k, v in own.items()]

            async def watch(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            token = _active.set(tracing)
            try:
                await self.app({**scope, "headers": headers}, receive, watch)
            finally:
                _active.reset(token)
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                if self.finish is not None:
                    self.finish(span, status)
