"""HTTP handlers: read and validate the request, call the orchestrator, map errors.

Handlers are plain endpoints taking a Starlette `Request`, declared in the router's one
route table (router/http/routes.py); bodies are decoded with msgspec. Every error a client
can cause comes back as a 4xx with an OpenAI-style body, never a 500.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pdgate.router import request_context
from pdgate.router.admission import Admission, Slot
from pdgate.router.config import RouterConfig
from pdgate.router.errors import (
    ModelNotFound,
    Overloaded,
    QuotaExceeded,
    RouterError,
    error_json,
)
from pdgate.router.http.client_deadlines import header_value, read_body_within
from pdgate.router.http.drain import Drain
from pdgate.router.http.relay_response import DisconnectWatch, RelayResponse
from pdgate.router.http.routes import RouteTable
from pdgate.router.input.limits import InputLimits
from pdgate.router.input.schema import ClientRequest, classify_prompt, parse_chat, parse_completion
from pdgate.router.metrics import RouterMetrics
from pdgate.router.orchestrator import Orchestrator, StreamResult
from pdgate.router.pool import EndpointPool
from pdgate.router.priority import (
    ClientKeys,
    KeySettings,
    apply_priority,
    priority_header,
    request_priority,
)
from pdgate.router.quotas import TokenQuotas
from pdgate.router.request_ids import InternalIds, client_request_id
from pdgate.router.served_models import ModelTable, ServedModel
from pdgate.router.tracing import span

__all__ = ["RouterState", "StateHolder", "install_routes"]

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder().encode
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE_MAX = 512  # W3C: at most 32 members; vendors cap the header near 512 bytes


def _valid_tracestate(value: str) -> bool:
    return len(value) <= _TRACESTATE_MAX and value.isascii() and value.isprintable()


# Forwarded to engines only when well-formed: a client's oversized or malformed header must
# never make an engine refuse the leg (that would count against the engine's breaker).
_TRACE_HEADERS: tuple[tuple[str, bytes, Callable[[str], bool]], ...] = (
    ("traceparent", b"traceparent", lambda v: _TRACEPARENT.fullmatch(v) is not None),
    ("tracestate", b"tracestate", _valid_tracestate),
)
_INLINE_PARSE_BYTES = 256 * 1024


@dataclass(frozen=True)
class RouterState:
    """Everything the handlers use, built by the app's lifespan."""

    config: RouterConfig
    metrics: RouterMetrics
    registry: CollectorRegistry
    pool: EndpointPool  # the default (first) model's, as `models.default.pool`
    orchestrator: Orchestrator  # the default model's
    started_at: int
    models: ModelTable  # every served model, by served name
    admission: Admission | None = None  # None: no admission control (tests, benches)
    limits: InputLimits = field(default_factory=InputLimits)  # request parsing bounds
    keys: ClientKeys = field(default_factory=lambda: ClientKeys(RouterConfig()))
    quotas: TokenQuotas = field(default_factory=TokenQuotas)  # per-key token windows


class StateHolder:
    """Gives handlers typed access to the state the lifespan builds (set while serving)."""

    def __init__(self) -> None:
        self._state: RouterState | None = None

    def set(self, state: RouterState | None) -> None:
        self._state = state

    @property
    def state(self) -> RouterState:
        if self._state is None:
            raise RuntimeError("router state used outside the app lifespan")
        return self._state


def error_response(exc: RouterError, request_id: str | None = None) -> Response:
    """The OpenAI-style JSON error response for `exc` (429s carry `Retry-After`)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(exc.retry_after_s)
    return Response(error_json(exc), exc.status, headers or None, "application/json")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; the work was cancelled."""


async def until_disconnected(
    request: Request, work: Awaitable[bytes | StreamResult]
) -> bytes | StreamResult:
    """Await `work`, but cancel it (and so its engine legs) and raise `ClientGone` when the
    client disconnects first. Call only after the request body was read: from then on the
    ASGI receive channel yields nothing but the disconnect.

    `work` runs in the caller's task (one watcher task per request, no task per leg
    set and no `asyncio.wait`): the watcher cancels the caller when the client leaves."""
    watch = DisconnectWatch(request.scope, request.receive)
    try:
        result = await work
    except asyncio.CancelledError:
        if not watch.fired:
            raise
        watch.uncancel()  # the legs have unwound (the orchestrator freed P's blocks)
        raise ClientGone from None
    finally:
        watch.stop()
    if watch.fired:  # the work swallowed the cancel and finished anyway: release it
        watch.uncancel()
        if isinstance(result, StreamResult):
            await result.chunks.aclose()
            result.close()
        raise ClientGone
    return result


def build_request(
    kind: str, raw: bytes, request: Request, request_id: str, models: ModelTable,
    client_id: str | None = None, limits: InputLimits | None = None,
) -> tuple[ClientRequest, ServedModel]:
    """Validate `raw` into a `ClientRequest` and find the model serving it (raises
    `RouterError` subclasses: `ModelNotFound` for a name no model serves).

    `request_id` is the router's internal id (router/request_ids.py): the only id engines
    see. `client_id` is the client's sanitised `X-Request-Id`, kept for logs. A served alias
    is rewritten to the model's `engine_model`, the name engines know; a LoRA adapter's name
    is kept and the request carries its `AdapterNeed`."""
    if kind == "chat":
        body, chat = parse_chat(raw, limits)
        req = ClientRequest("chat", "/v1/chat/completions", body, chat, request_id, {})
    else:
        body, comp = parse_completion(raw, limits)
        req = ClientRequest("completion", "/v1/completions", body, comp, request_id, {})
        req.prompt, req.batch = classify_prompt(comp.prompt)
    model = req.params.model
    served, req.adapter = models.find(model)
    # An adapter's name is what engines know it by; a served alias is rewritten.
    if model is not None and req.adapter is None and model != served.engine_model:
        req.body["model"] = served.engine_model
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    for name, raw_name, valid in _TRACE_HEADERS:
        if (value := header_value(request.scope, raw_name)) is not None and valid(value):
            headers[name] = value
    req.engine_headers = headers
    req.client_headers = request.headers
    req.client_request_id = client_id
    return req, served


def _completion_handler(
    holder: StateHolder, kind: str, route: str
) -> Callable[[Request], Awaitable[Response]]:
    internal_ids = InternalIds()

    async def handler(request: Request) -> Response:
        st = holder.state
        t0 = time.perf_counter()
        ids = _Ids(internal_ids.new(), client_id(request.scope, st.config.request_id_headers))
        request_context.bind_ids(ids.internal, ids.client)  # for log lines and access line
        record = request_context.current()
        cfg = st.config
        m = st.metrics  # the router's view until the request's model is known
        try:
            # The body first, under its deadlines: a client trickling its upload must not
            # hold an admission slot (those are for work the engines do). It is parsed
            # before admission, which orders the queue by the priority it asks.
            raw = await read_body_within(request, cfg.max_body_bytes, cfg.body_timeout_s,
                                         cfg.body_chunk_timeout_s)
            if st.admission is not None:
                st.admission.check_room()  # a full queue refuses before any parsing
            key = st.keys.of(request.scope)
            st.quotas.check(key)
            args = (kind, raw, request, ids.internal, st.models, ids.client, st.limits)
            # A megabyte body takes msgspec tens of ms to decode: not on the event loop.
            req, served = build_request(*args) if len(raw) <= _INLINE_PARSE_BYTES else \
                await anyio.to_thread.run_sync(build_request, *args)
            m = served.metrics
            if record is not None:
                record.model = served.name  # the access line's model, before any answer
            slot = await _enter(st, req, served, key, request.scope)
        except RouterError as exc:
            if isinstance(exc, Overloaded):
                m.child(m.admission_rejected, exc.reason).inc()
            _count(m, route, exc.status, t0)
            return error_response(exc, ids.echo)
        except ClientDisconnect:  # left mid-upload: an ordinary event, not a bug to log
            _count(m, route, 499, t0)
            return Response(b"", 499)
        admitted = _Admitted(req, served, key, slot)
        response = await serve(request, admitted, st, t0, ids)
        done = functools.partial(_finished, admitted, st, record)
        if isinstance(response, RelayResponse):
            response.on_close(done)
        else:
            done()
        return response

    async def serve(
        request: Request, admitted: _Admitted, st: RouterState, t0: float, ids: _Ids
    ) -> Response:
        req, served = admitted.req, admitted.served
        m = served.metrics
        try:
            # Only while the router starts: engines probed every 0.2 s until ready.
            await served.pool.wait_first_ready(st.config.startup_wait_s)
            if req.adapter is not None:
                req.adapter.check_decode()
            result = await until_disconnected(request, served.orchestrator.handle(req))
        except RouterError as exc:
            _count(m, route, exc.status, t0)
            return error_response(exc, ids.echo)
        except ClientGone:
            _count(m, route, 499, t0)  # nginx's "client closed request"; nobody reads it
            return Response(b"", 499)
        except Exception:  # a bug: log it, answer like an engine would, keep serving
            log.exception("request %s (client id %s) failed", ids.internal, ids.client)
            _count(m, route, 500, t0)
            return error_response(RouterError("internal router error"), ids.echo)
        # X-Pdgate-Request-Id: the id engines logged this request under (for operators).
        headers = {"X-Request-Id": ids.echo, "X-Pdgate-Request-Id": ids.internal,
                   **_engine_headers(req)}
        if (record := request_context.current()) is not None:
            record.engines.update(req.served_by)  # the engines the headers name
        if isinstance(result, bytes):
            _count(m, route, 200, t0)
            return Response(result, 200, headers, "application/json")
        m.child(m.requests, route, "200").inc()
        duration = m.child(m.request_duration, route)
        done = lambda: duration.observe(time.perf_counter() - t0)  # noqa: E731
        return RelayResponse(result, headers, done,
                             st.config.stream_write_timeout_s)

    return handler


async def _enter(st: RouterState, req: ClientRequest, served: ServedModel,
                 key: KeySettings | None, scope: Any) -> Slot | None:
    """The request's priority (router/priority.py) set on its legs, then its admission
    slot, waited for in the fair queue (None: no admission control). The key's quota is
    checked again once the slot is there: requests that ended while this one queued may
    have spent it."""
    priority = request_priority(req.body, priority_header(scope), key)
    apply_priority(req.body, priority, served.config.forward_priority)
    if (record := request_context.current()) is not None:
        record.priority = priority
        record.client_key = key.name if key is not None else None
    if st.admission is None:
        return None
    with span("admission_wait"):
        slot = await st.admission.acquire(priority, key.name if key else "")
    try:
        st.quotas.check(key)
    except QuotaExceeded:
        slot.release()
        raise
    return slot


@dataclass(slots=True)
class _Admitted:
    """A validated request holding its admission slot (None: no admission control)."""

    req: ClientRequest
    served: ServedModel
    key: KeySettings | None
    slot: Slot | None


def _finished(admitted: _Admitted, st: RouterState,
              record: request_context.RequestRecord | None) -> None:
    """The request is over (its answer sent, or its stream closed): free its slot and
    charge its key the tokens of the usage the client was relayed (router/quotas.py),
    counted in `pdgate_client_tokens_total{key}` too."""
    if admitted.slot is not None:
        admitted.slot.release()
    key = admitted.key
    if record is None or key is None:
        return
    tokens = (record.prompt_tokens or 0) + (record.completion_tokens or 0)
    if tokens > 0:
        st.quotas.charge(key, tokens)
        st.metrics.child(st.metrics.client_tokens, key.name).inc(tokens)


def client_id(scope: Any, names: list[str]) -> str | None:
    """The client's own request id, sanitised: the first of `names` (--request-id-headers)
    the request carries. One scan of the raw headers whatever the number of names (most
    requests carry none of them)."""
    wanted = _wire_names(tuple(names))
    found: dict[bytes, bytes] = {}
    for key, value in scope["headers"]:
        if key in wanted:
            found.setdefault(key, value)
    for name in wanted:
        if (value := found.get(name)) is not None:
            return client_request_id(value.decode("latin-1"))
    return None


@functools.lru_cache(maxsize=16)
def _wire_names(names: tuple[str, ...]) -> dict[bytes, None]:
    """`names` as the lower-case bytes ASGI headers carry, in their order of preference."""
    return dict.fromkeys(name.lower().encode("latin-1") for name in names)


@dataclass(frozen=True, slots=True)
class _Ids:
    internal: str  # engines' key
    client: str | None  # the client's sanitised X-Request-Id

    @property
    def echo(self) -> str:
        """The response's X-Request-Id: the client's own id, else ours."""
        return self.client or self.internal


def _engine_headers(req: ClientRequest) -> dict[str, str]:
    # Which engines served the legs: cheap to add, and what an operator asks first.
    return {f"X-Pdgate-{role.capitalize()}-Engine": url for role, url in req.served_by.items()}


def _count(m: RouterMetrics, route: str, status: int, t0: float) -> None:
    m.child(m.requests, route, str(status)).inc()
    m.child(m.request_duration, route).observe(time.perf_counter() - t0)


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json(obj), status, media_type="application/json")


def install_routes(table: RouteTable, holder: StateHolder, drain: Drain | None = None) -> None:
    """Declare the OpenAI routes and the operational endpoints in `table`. `drain`: this
    process's drain (router/http/drain.py): `/ready` answers 503 while it is on."""
    for path, kind in (("/v1/completions", "completion"), ("/v1/chat/completions", "chat")):
        table.add("POST", path, _completion_handler(holder, kind, path))

    def model_card(served: ServedModel, name: str) -> dict[str, object]:
        # vLLM's fields too: `root` the model the engines load, `parent` None (not a LoRA),
        # `max_model_len` the context length (None when the router knows none); both as
        # the engines report them where they do. `ready`: whether this model has a ready
        # pair now.
        return {"id": name, "object": "model", "created": holder.state.started_at,
                "owned_by": "pdgate", "root": served.root, "parent": None,
                "max_model_len": served.max_model_len, "ready": served.pool.ready()}

    def adapter_card(served: ServedModel, name: str) -> dict[str, object]:
        # As vLLM lists a loaded adapter: `parent` its base model, `root` its source.
        adapters = served.adapters
        return {"id": name, "object": "model", "created": holder.state.started_at,
                "owned_by": "pdgate", "root": adapters.source(name) if adapters else None,
                "parent": served.name, "max_model_len": served.max_model_len,
                "ready": served.pool.ready()}

    async def models(request: Request) -> Response:
        data = [model_card(m, name) for m in holder.state.models.models
                for name in m.config.served_names]
        data += [adapter_card(m, name) for m in holder.state.models.models
                 if m.adapters is not None for name in m.adapters.names()]
        return _json_response({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        try:
            served, adapter = holder.state.models.find(name)
        except ModelNotFound as exc:
            return error_response(exc)
        card = model_card if adapter is None else adapter_card
        return _json_response(card(served, name))

    async def health(request: Request) -> Response:
        return _json_response({"status": "ok"})

    async def ready(request: Request) -> Response:
        # ?model=NAME: that model alone; else every model must have a ready pair. The
        # top-level counts are summed over the models answered for; `models` (each one's
        # verdict) is left out for a one-model router asked about all, as before models.
        table = holder.state.models
        name = request.query_params.get("model")
        try:
            chosen = table.models if name is None else (table.resolve(name),)
        except ModelNotFound as exc:
            return error_response(exc)
        body: dict[str, object] = {
            "prefill_healthy": sum(len(m.pool.healthy("prefill")) for m in chosen),
            "decode_healthy": sum(len(m.pool.healthy("decode")) for m in chosen),
        }
        if name is not None or len(table.models) > 1:
            body["models"] = {m.name: m.ready_body() for m in chosen}
        if drain is not None and drain.active:  # shutting down: fail first, serve on
            return _json_response({**drain.status(), **body}, 503)
        if all(m.pool.ready() for m in chosen):
            return _json_response({"status": "ready", **body})
        return _json_response({"status": "not ready", **body}, 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(holder.state.registry), media_type=CONTENT_TYPE_LATEST)

    table.add("GET", "/v1/models", models)
    # `:path`: served names may hold slashes ("org/model"), as vLLM's do.
    table.add("GET", "/v1/models/{model:path}", model)
    table.add("GET", "/health", health)
    table.add("GET", "/ready", ready)
    table.add("GET", "/metrics", metrics)
