"""OpenTelemetry tracing shared by the router and the shim: setup, W3C propagation, and an
ASGI middleware that opens one SERVER span per HTTP request.

Off unless an OTLP endpoint is given (`--otlp-traces-endpoint`) or the standard environment
asks for it (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`;
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` switch it off). When off, nothing
of OpenTelemetry is imported. Tracing never stops a process: asked for without the `otel`
extra (`pip install 'pdgate[otel]'`), or with a setting this SDK cannot honour, the process
logs one warning and serves untraced (the OpenTelemetry operator injects
`OTEL_EXPORTER_OTLP_ENDPOINT` into every pod, traced or not).

The standard variables are honoured as the OpenTelemetry specification says:
`OTEL_SERVICE_NAME` (and `service.name` in `OTEL_RESOURCE_ATTRIBUTES`) over the process'
default name; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`:
`http/protobuf` (the default; the endpoint flag is the full URL, `.../v1/traces`) or `grpc`
(`http://host:4317`; the scheme says whether TLS is used); `OTEL_TRACES_SAMPLER` and
`OTEL_TRACES_SAMPLER_ARG` (default `parentbased_always_on`). The exporters read the rest
(headers, timeouts, certificates, compression) themselves. No global tracer provider is set:
each process builds its own `Tracing` and passes it where spans are made.

The middleware continues the caller's trace (`traceparent`/`tracestate`) and rewrites the
request's `traceparent` to its own span before the app sees it, so a router that forwards
`traceparent` on its engine legs makes the engines' spans children of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["PROTOCOLS", "Tracing", "TracingMiddleware", "TracingUnavailable",
           "check_available", "exporter_protocol", "open_tracing", "record_span",
           "request_span", "sampler_setting", "tracing_requested"]

log = logging.getLogger("pdgate.tracing")
_OFF = ("true", "1", "yes")
# OTEL_EXPORTER_OTLP_*PROTOCOL value -> the exporter module that speaks it.
PROTOCOLS = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}
_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
             "parentbased_always_off", "parentbased_traceidratio")
_DEFAULT_SAMPLER = "parentbased_always_on"

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
    """Tracing was asked for but cannot run here (SDK or exporter missing, a protocol this
    SDK does not speak, an exporter that refuses its settings)."""


def tracing_requested(endpoint: str | None, environ: Mapping[str, str]) -> bool:
    """Does the flag or the standard OTEL_* environment turn tracing on?"""
    if environ.get("OTEL_SDK_DISABLED", "").lower() in _OFF:
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    return bool(endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def exporter_protocol(environ: Mapping[str, str]) -> str:
    """The OTLP protocol asked for (the traces variable over the general one), lower-cased;
    `http/protobuf` when neither is set. Raises `TracingUnavailable` for one not spoken."""
    value = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
             or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if value not in PROTOCOLS:
        raise TracingUnavailable(f"OTLP protocol {value!r} is not supported "
                                 f"(use one of {', '.join(PROTOCOLS)})")
    return value


def sampler_setting(environ: Mapping[str, str]) -> tuple[str, float]:
    """(OTEL_TRACES_SAMPLER, its ratio) as the specification reads them: an unknown sampler
    is `parentbased_always_on` and a ratio that is not a number in [0, 1] is 1.0, each
    with a warning."""
    name = environ.get("OTEL_TRACES_SAMPLER", _DEFAULT_SAMPLER).strip().lower()
    if name not in _SAMPLERS:
        log.warning("OTEL_TRACES_SAMPLER=%r is not a sampler this SDK knows; using %s",
                    name, _DEFAULT_SAMPLER)
        name = _DEFAULT_SAMPLER
    ratio = 1.0
    if name.endswith("traceidratio") and "OTEL_TRACES_SAMPLER_ARG" in environ:
        raw = environ["OTEL_TRACES_SAMPLER_ARG"]
        try:
            ratio = float(raw)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a ratio in [0, 1]; using 1.0", raw)
            ratio = 1.0
    return name, ratio


def _sampler(name: str, ratio: float) -> Any:
    from opentelemetry.sdk.trace import sampling

    base = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
            "traceidratio": None}[name.removeprefix("parentbased_")]
    root = sampling.TraceIdRatioBased(ratio) if base is None else base
    return sampling.ParentBased(root) if name.startswith("parentbased_") else root


def check_available(environ: Mapping[str, str]) -> str:
    """The protocol to export with, once the SDK and that protocol's exporter import;
    raises `TracingUnavailable` otherwise."""
    protocol = exporter_protocol(environ)
    try:
        importlib.import_module("opentelemetry.sdk.trace")
        importlib.import_module(PROTOCOLS[protocol])
    except ImportError as exc:
        raise TracingUnavailable(
            f"tracing is configured but OpenTelemetry is missing ({exc.name}): "
            "pip install 'pdgate[otel]'") from None
    return protocol


def open_tracing(service: str, endpoint: str | None, environ: Mapping[str, str],
                 attributes: Mapping[str, str] | None = None) -> Tracing | None:
    """The process' tracer, or None when tracing is off or cannot run here (then one
    warning says why). Call `shutdown()` on it at exit."""
    if not tracing_requested(endpoint, environ):
        return None
    try:
        return Tracing(service, endpoint, environ, attributes)
    except TracingUnavailable as exc:
        log.warning("%s; serving without tracing", exc)
        return None


def _service_named_by(environ: Mapping[str, str]) -> bool:
    """Does the environment name the service (which then wins over our default)?"""
    if environ.get("OTEL_SERVICE_NAME"):
        return True
    pairs = environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(p.partition("=")[0].strip() == "service.name" for p in pairs)


class Tracing:
    """One process' tracer, exporting over OTLP (HTTP or gRPC) in batches; `shutdown()`
    flushes. Raises `TracingUnavailable` when it cannot be built."""

    def __init__(self, service: str, endpoint: str | None, environ: Mapping[str, str],
                 attributes: Mapping[str, str] | None = None) -> None:
        protocol = check_available(environ)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # Resource.create adds OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME under ours.
        own = dict(attributes or {})
        if not _service_named_by(environ):
            own["service.name"] = service
        exporter_class = importlib.import_module(PROTOCOLS[protocol]).OTLPSpanExporter
        try:
            # The endpoint flag wins; without it the exporter reads the OTEL_* environment.
            exporter = exporter_class(endpoint=endpoint) if endpoint else exporter_class()
        except (ValueError, TypeError, OSError) as exc:
            raise TracingUnavailable(f"the OTLP {protocol} exporter refused its settings: "
                                     f"{exc}") from None
        self._provider = TracerProvider(resource=Resource.create(own),
                                        sampler=_sampler(*sampler_setting(environ)))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.protocol = protocol
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
