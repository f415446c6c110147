"""Pass-through routes: the OpenAI and vLLM routes served by one engine, without P/D.

`POST /v1/embeddings`, `/v1/rerank`, `/v1/score`, `/v1/responses`, `/tokenize`,
`/detokenize` and `GET /version` go to one healthy engine of `--passthrough-role` (the
decode pool by default), picked by that role's policy, as a vLLM engine would serve them
alone: its status, body and content type come back unchanged (a `text/event-stream` answer
is streamed). They pass what a completion passes: the route table's middlewares (keys,
CORS, tracing, access log), the body's size and time limits, the JSON depth limit and the
model check (a served alias is rewritten to the engines' name), an admission slot,
`pdgate_requests_total` and the request duration by route. Engines get the router's own
request id, never the client's. No retry: `/v1/responses` may not be idempotent. Other
`/v1/*` paths stay 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pdgate.router import request_context
from pdgate.router.adapters import AdapterNeed
from pdgate.router.admission import Slot
from pdgate.router.engines.error_map import translate
from pdgate.router.engines.http11 import Response as EngineResponse
from pdgate.router.errors import (
    EngineReplyTooLarge,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RouterError,
)
from pdgate.router.http.api import RouterState, StateHolder, client_id, error_response
from pdgate.router.http.client_deadlines import read_body_within
from pdgate.router.http.routes import Endpoint as RouteEndpoint
from pdgate.router.http.routes import RouteTable
from pdgate.router.input.limits import check_json_depth
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import PickContext, choose
from pdgate.router.pool import Endpoint
from pdgate.router.request_ids import InternalIds
from pdgate.router.served_models import ServedModel
from pdgate.router.tracing import span

__all__ = ["PASSTHROUGH_ROUTES", "install_passthrough"]

PASSTHROUGH_ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"), ("POST", "/v1/score"),
    ("POST", "/v1/responses"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/version"),
)
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


def install_passthrough(table: RouteTable, holder: StateHolder) -> None:
    """Declare the pass-through routes in the router's route table."""
    ids = InternalIds()
    for method, path in PASSTHROUGH_ROUTES:
        table.add(method, path, _handler(holder, ids, path))


def _handler(holder: StateHolder, ids: InternalIds, route: str) -> RouteEndpoint:
    async def handler(request: Request) -> Response:
        st, t0 = holder.state, time.perf_counter()
        internal = ids.new()
        client = client_id(request.scope, st.config.request_id_headers)
        request_context.bind_ids(internal, client)
        echo = client or internal
        slot: Slot | None = None
        m = st.metrics  # the router's view until the request's model is known
        try:
            body, served, adapter = await _read_body(request, st)
            m = served.metrics
            if st.admission:
                # The key's flow and priority in the fair queue (no token quota here: these
                # routes' usage is not counted).
                key = st.keys.of(request.scope)
                with span("admission_wait"):
                    slot = await st.admission.acquire(*((key.priority, key.name) if key
                                                        else (0, "")))
            response = await _forward(st, served, request.method, route, body, internal, echo,
                                      adapter)
        except RouterError as exc:
            if isinstance(exc, Overloaded):
                st.metrics.child(st.metrics.admission_rejected, exc.reason).inc()
            if slot is not None:
                slot.release()
            _count(m, route, exc.status, t0)
            return error_response(exc, echo)
        _count(m, route, response.status_code, t0)
        if slot is not None:
            if isinstance(response, StreamingResponse):
                _then(response, slot.release)
            else:
                slot.release()
        return response

    return handler


async def _read_body(request: Request, st: RouterState) -> tuple[
        bytes | None, ServedModel, AdapterNeed | None]:
    """The request body, bounded like a completion's, the model serving it (the default
    without a body or a `model`) and the LoRA adapter it names; an alias is rewritten to
    the engines' name (an adapter's name is what the engines know it by)."""
    if request.method != "POST":
        return None, st.models.default, None
    cfg = st.config
    raw = await read_body_within(request, cfg.max_body_bytes, cfg.body_timeout_s,
                                 cfg.body_chunk_timeout_s)
    check_json_depth(raw, cfg.max_json_depth)
    try:
        body = _json_decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise InvalidRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model")
    served, adapter = st.models.find(model if isinstance(model, str) else None)
    if model is not None and not isinstance(model, str):
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    if model is not None and adapter is None and model != served.engine_model:
        body["model"] = served.engine_model
        return _json_encode(body), served, None
    return raw, served, adapter


async def _forward(st: RouterState, served: ServedModel, method: str, path: str,
                   body: bytes | None, internal: str, echo: str,
                   adapter: AdapterNeed | None = None) -> Response:
    """Send the request to one engine of the model's pass-through role (a colocated
    model's decode engines) and relay its answer."""
    parts = served.orchestrator.pull.parts
    pool = served.pool
    role = served.config.passthrough_role if served.config.pd_mode != "colocated" else "decode"
    await pool.wait_first_ready(st.config.startup_wait_s)
    # A LoRA adapter's request goes to an engine holding it (router/adapters.py).
    ep = await choose(pool, role, parts.policies[role],
                      PickContext(internal, adapter=adapter))
    headers = {"X-Request-Id": internal}
    if body is not None:
        headers["Content-Type"] = "application/json"
    held = contextlib.ExitStack()  # the engine's in-flight count, until the answer is sent
    held.enter_context(pool.track(ep))
    try:
        resp = await parts.engines.forward(ep.url, method, path, body, headers)
    except RouterError:
        held.close()
        ep.health.record_failure()
        raise
    if resp.status >= 500:
        ep.health.record_failure()
    out = {"X-Request-Id": echo, "X-Pdgate-Request-Id": internal,
           f"X-Pdgate-{role.capitalize()}-Engine": ep.url}
    media = resp.headers.get(b"content-type", b"application/json").decode("latin-1")
    if resp.content_type == "text/event-stream":
        return StreamingResponse(
            _chunks(ep, resp, st.config.decode_idle_timeout_s), resp.status, out, media,
            background=BackgroundTask(_close, resp, held))
    with held:
        raw = await _read_all(ep, resp, st.config.max_engine_reply_bytes,
                              st.config.decode_idle_timeout_s)
    return Response(raw, resp.status, out, media)


async def _read_all(ep: Endpoint, resp: EngineResponse, cap: int, idle_s: float) -> bytes:
    pieces: list[bytes] = []
    size = 0
    try:
        with translate(ep.url, "pass-through reply"):
            while piece := await resp.read_some(_deadline(idle_s)):
                size += len(piece)
                if size > cap:
                    raise EngineReplyTooLarge(
                        f"engine {ep.url} sent a reply over {cap} bytes")
                pieces.append(piece)
        resp.release()
    finally:
        resp.close()  # no-op once released
    return b"".join(pieces)


async def _chunks(ep: Endpoint, resp: EngineResponse, idle_s: float) -> AsyncIterator[bytes]:
    # Past the status line the client has its answer: a broken stream just ends.
    try:
        with translate(ep.url, "pass-through stream"):
            while piece := await resp.read_some(_deadline(idle_s)):
                yield piece
        resp.release()
    except RouterError:
        ep.health.record_failure()


async def _close(resp: EngineResponse, held: contextlib.ExitStack) -> None:
    resp.close()  # no-op once released
    held.close()


def _then(response: StreamingResponse, release: Callable[[], None]) -> None:
    """Run `release` after the stream's own cleanup (the client's slot outlives the
    handler while the stream runs)."""
    task = response.background

    async def both() -> None:
        try:
            if task is not None:
                await task()
        finally:
            release()

    response.background = BackgroundTask(both)


def _deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


def _count(m: RouterMetrics, route: str, status: int, t0: float) -> None:
    m.child(m.requests, route, str(status)).inc()
    m.child(m.request_duration, route).observe(time.perf_counter() - t0)
