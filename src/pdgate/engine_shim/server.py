"""The shim's OpenAI-compatible HTTP API (FastAPI app factory; no module state).

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
GET /health, GET /metrics, and the internal POST /v1/kv/abort `{"request_id"}` that the router
calls to free a prefill engine's pinned blocks (or a decode engine's reservation) when a leg
failed. Notify/push flows (engine_shim/push.py) add POST /v1/kv/reserve `{"request_id",
"num_tokens"}` (D sets blocks aside for P's WRITE) and GET|POST /v1/kv/info (engine id and
side channel, so a router can point D at P).

`kv_transfer_params` follow vLLM's NixlConnector: `do_remote_decode` makes this engine the
prefill side (the reply carries the params a decode engine needs), `do_remote_prefill` makes
it the decode side (it reads the prompt's KV before decoding). The connector request id is the
`X-Request-Id` header when present (the router sends the same one on both legs).

The HTTP edge (`ServerSettings`): with an API key every route but `GET /health` (and
`GET /metrics` unless `protect_metrics`) needs `Authorization: Bearer <key>` (`auth.py`);
bodies over `max_body_bytes` are refused with a 413 before they are buffered
(`body_limit.py`). Refusals are counted in `pdgate_shim_http_refused_total{reason}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from pdgate.contract.kv_contract import PushDecodeParams
from pdgate.engine_shim import openai_types as ot
from pdgate.engine_shim.auth import EngineAuth
from pdgate.engine_shim.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from pdgate.engine_shim.connector_api import KVConnectorAPI
from pdgate.engine_shim.engine import Engine, EngineError, RequestStream
from pdgate.engine_shim.sequence import GenerateRequest, KVRole, StepOutput
from pdgate.engine_shim.tracing import span
from pdgate.engine_shim.warmup import warm_up

log = logging.getLogger(__name__)

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI / vLLM legacy-completions default


ManagedConnector = KVConnectorAPI  # the name the CLI and the tests import
ConnectorFactory = Callable[[Engine], KVConnectorAPI]


class ReserveRequest(msgspec.Struct, kw_only=True):
    """POST /v1/kv/reserve (notify mode, router -> D): blocks for a `num_tokens` prompt."""

    request_id: str
    num_tokens: int


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The HTTP edge of one shim (from `cli.py`). `api_key` None: every route is open (a
    warning is logged at startup); `protect_metrics`: GET /metrics needs the key too."""

    api_key: str | None = None
    protect_metrics: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def create_app(engine: Engine, *, connector_factory: ConnectorFactory | None = None,
               settings: ServerSettings | None = None) -> FastAPI:
    """Build the app around a loaded `engine`. The lifespan starts the engine loop and (when
    `connector_factory` is given) the KV connector, and stops both on shutdown. `settings`:
    authentication and body limit (default: no key, `DEFAULT_MAX_BODY_BYTES`)."""
    edge = settings or ServerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connector = None
        if connector_factory is not None:
            # Started first: if its side channel cannot bind, startup fails with nothing
            # else running.
            connector = connector_factory(engine)
            await asyncio.to_thread(connector.start)
            engine.attach_connector(connector)
            leased = connector.leased_blocks
            engine.metrics.blocks_leased.set_function(lambda: float(leased()))
        if edge.api_key is None:
            log.warning("no API key (--api-key, PDGATE_ENGINE_API_KEY): every route of this "
                        "engine, including the internal /v1/kv/* and /debug/* ones, is open "
                        "to anyone who can reach its port")
        try:
            await engine.start()
            await warm_up(engine, engine.config.warmup_tokens)
            yield
        finally:
            await engine.stop()  # fails what is in flight and frees its blocks
            if connector is not None:
                engine.attach_connector(None)
                await asyncio.to_thread(connector.close)  # frees the leased blocks

    app = FastAPI(title="pdgate engine shim", lifespan=lifespan)
    app.add_exception_handler(ot.RequestError, _request_error)  # type: ignore[arg-type]
    app.add_exception_handler(EngineError, _engine_error)  # type: ignore[arg-type]
    _add_routes(app, engine, edge.api_key)
    _add_edge(app, engine, edge)
    return app


def _add_edge(app: FastAPI, engine: Engine, edge: ServerSettings) -> None:
    """The middlewares; the last added runs first: auth refuses before the body is read."""
    refused = engine.metrics.http_refused
    app.add_middleware(BodyLimit, max_bytes=edge.max_body_bytes,
                       on_refuse=refused.labels(reason="body_too_large").inc)
    if edge.api_key is not None:
        app.add_middleware(EngineAuth, api_key=edge.api_key,
                           protect_metrics=edge.protect_metrics,
                           on_refuse=refused.labels(reason="unauthorized").inc)


def _add_routes(app: FastAPI, engine: Engine, api_key: str | None) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = ot.decode_request(await request.body(), ot.CompletionRequest)
        prompt = ot.completion_prompt(req.prompt)
        if isinstance(prompt, str):
            engine.check_prompt_chars(
                len(prompt), ot.max_tokens(req, _COMPLETIONS_DEFAULT_MAX_TOKENS))
            with span("tokenize", **{"pdgate.prompt_chars": len(prompt)}):
                ids = await engine.encode_async(prompt,
                                                add_special_tokens=req.add_special_tokens)
        else:
            ids = _check_token_ids(engine, prompt)
        return await _serve(engine, request, req, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = ot.decode_request(await request.body(), ot.ChatCompletionRequest)
        messages = ot.chat_messages(req.messages)
        try:
            text = await engine.render_chat_async(messages)
        except Exception as e:  # a template may raise on roles it does not know
            raise ot.RequestError(f"chat template failed: {e}", param="messages") from e
        engine.check_prompt_chars(len(text), ot.max_tokens(req, None))
        with span("tokenize", **{"pdgate.prompt_chars": len(text)}):
            ids = await engine.encode_async(text, add_special_tokens=req.add_special_tokens)
        return await _serve(engine, request, req, ids, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        created = int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "pdgate",
                 "root": str(engine.model_dir), "max_model_len": engine.max_model_len}
                for name in engine.served_model_names]
        return _json({"object": "list", "data": data})

    # Open even with a key (probes carry none); says whether the other routes need one.
    health_body = msgspec.json.encode(
        {"status": "ok", "auth": "unauthenticated" if api_key is None else "api-key"})

    @app.get("/health")
    async def health() -> Response:
        return Response(health_body, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/kv/abort")
    async def kv_abort(request: Request) -> Response:
        body = ot.decode_request(await request.body(), ot.AbortRequest)
        if engine.connector is None:
            raise ot.RequestError("this engine has no KV connector", status=404,
                                  error_type="NotFoundError")
        engine.connector.abort(body.request_id)
        # A WRITE into the reservation may still land: its blocks wait out the grace.
        grace = engine.config.reservation_abort_grace if body.write_possible else 0.0
        engine.reservations.release(body.request_id, grace=grace)
        return _json({"request_id": body.request_id})

    @app.post("/v1/kv/reserve")
    async def kv_reserve(request: Request) -> Response:
        body = ot.decode_request(await request.body(), ReserveRequest)
        connector = engine.connector
        if connector is None:
            raise ot.RequestError("this engine cannot receive pushed KV", status=404,
                                  error_type="NotFoundError")
        r = await engine.reserve(body.request_id, body.num_tokens)
        return _json({**connector.kv_info(), "reservation_id": r.reservation_id,
                      "block_ids": list(r.block_ids), "num_tokens": r.num_tokens})

    @app.api_route("/v1/kv/info", methods=["GET", "POST"])
    async def kv_info() -> Response:
        if engine.connector is None:
            raise ot.RequestError("this engine has no KV connector", status=404,
                                  error_type="NotFoundError")
        return _json(engine.connector.kv_info())

    @app.get("/debug/kv_transfers")
    async def kv_transfers() -> Response:
        return _json({"transfers": list(engine.transfer_log.entries)})


async def _serve(
    engine: Engine, request: Request, req: ot.CompletionRequest | ot.ChatCompletionRequest,
    prompt_ids: list[int], *, chat: bool,
) -> Response:
    """Validate the rest of the request, admit it, and answer as JSON or SSE."""
    gen, model = _generate_request(engine, request, req, prompt_ids, chat=chat)
    stream = await _admit_unless_disconnected(request, engine, gen)
    if stream is None:  # the client left while the request queued for KV blocks
        return Response(status_code=499)
    # What the request waits behind before its first read starts the work (a decode's KV
    # transfer): the SSE status and headers are sent first; a JSON answer's collector task.
    stream.waits_for = "response_head" if req.stream else "collector_task"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = ot.ReplyHead(id=f"{'chatcmpl' if chat else 'cmpl'}-{gen.request_id}",
                        created=int(time.time()), model=model, include_usage=include_usage)
    headers = {"X-Request-Id": gen.request_id}
    if req.stream:
        return _ClosingStreamingResponse(
            stream, _sse_events(stream, head, chat, gen.continues_stream,
                                prompt_ids if req.return_token_ids else None),
            media_type="text/event-stream",
            headers=headers,
        )
    result = await _collect_unless_disconnected(request, stream)
    if result is None:  # the client went away; nobody will read this
        return Response(status_code=499)
    text, final = result
    if isinstance(req, ot.ChatCompletionRequest):
        body = ot.chat_body(head, text, final)
    else:
        ids = prompt_ids if req.return_token_ids else None
        body = ot.completion_body(head, text, final, ids)
    return _json(body, headers=headers)


def _generate_request(
    engine: Engine, request: Request, req: ot.CompletionRequest | ot.ChatCompletionRequest,
    prompt_ids: list[int], *, chat: bool,
) -> tuple[GenerateRequest, str]:
    names = engine.served_model_names
    if req.model is not None and req.model not in names:
        raise ot.RequestError(f"The model `{req.model}` does not exist.", param="model",
                              status=404, error_type="NotFoundError")
    ot.check_unsupported(req)
    budget = ot.max_tokens(req, None if chat else _COMPLETIONS_DEFAULT_MAX_TOKENS)
    if budget is None:
        budget = max(1, engine.max_model_len - len(prompt_ids))
    if req.min_tokens < 0 or req.min_tokens > budget:
        raise ot.RequestError(
            f"min_tokens must be in [0, max_tokens={budget}], got {req.min_tokens}",
            param="min_tokens",
        )
    kv = ot.kv_transfer_params(req.kv_transfer_params)
    params = kv.params if kv is not None else None
    role = KVRole.NONE
    if params is not None and params.do_remote_decode:
        role = KVRole.PREFILL
    elif params is not None and params.do_remote_prefill:
        role = KVRole.DECODE
    leg = kv.leg if kv is not None else None
    gen = GenerateRequest(
        request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
        prompt_ids=tuple(prompt_ids),
        sampling=ot.sampling_params(req),
        max_tokens=budget,
        min_tokens=req.min_tokens,
        stop=ot.stop_strings(req),
        include_stop_str=req.include_stop_str_in_output,
        stop_token_ids=tuple(_check_token_ids(engine, req.stop_token_ids or [], "stop_token_ids")),
        ignore_eos=req.ignore_eos,
        role=role,
        remote=req.kv_transfer_params if role is not KVRole.NONE else None,
        pdgate=leg,
        remote_block_ids=tuple(params.remote_block_ids or [])
        if params is not None and role is not KVRole.NONE else (),
        first_token_ids=ot.first_token_ids(kv, engine.model.config.vocab_size, budget),
        continue_after_prefill=isinstance(leg, PushDecodeParams) and leg.continue_after_prefill,
        model=req.model or names[0],
        every_token=req.stream and req.return_token_ids,
    )
    return gen, req.model or names[0]


async def _collect(stream: RequestStream) -> tuple[str, StepOutput]:
    parts: list[str] = []
    final: StepOutput | None = None
    async with stream:
        async for out in stream:
            parts.append(out.text)
            final = out
    assert final is not None  # the stream always ends with a finished output
    return "".join(parts), final


async def _collect_unless_disconnected(
    request: Request, stream: RequestStream
) -> tuple[str, StepOutput] | None:
    """Run the request to completion, cancelling it (and freeing its blocks) if the client
    goes away first, as vLLM does for non-streaming requests."""
    work = asyncio.ensure_future(_collect(stream))
    try:
        await _done_before_disconnect(request, work)
    finally:
        if not work.done():
            # Only *asked* to cancel: the task is not cancelled() yet, so its result must
            # not be read (that raised InvalidStateError, a 500 for a client already gone).
            work.cancel()
            stream.close()
            gone = True
        else:
            gone = False
    return None if gone or work.cancelled() else work.result()


async def _admit_unless_disconnected(request: Request, engine: Engine,
                                     gen: GenerateRequest) -> RequestStream | None:
    """`engine.open(gen)`, or None when the client goes away while the request queues for
    KV blocks: a request nobody will read gives up its place (FIFO) at once. A router
    whose client left closes its legs; without this each dead leg still took its blocks
    when its turn came (a push-mode D then held them for its push grace), and under a
    burst of abandoned requests the live ones queued behind them for tens of seconds."""
    admit = asyncio.ensure_future(engine.open(gen))
    if await _done_before_disconnect(request, admit):
        return admit.result()
    admit.cancel()  # Engine.open frees what it took and counts the request as abandoned
    try:
        late = await admit
    except asyncio.CancelledError:
        return None
    # The blocks came as the cancel did, and asyncio.wait_for kept the result: free them.
    late.close()
    return None


async def _done_before_disconnect(request: Request, work: asyncio.Future[Any]) -> bool:
    """Wait for `work` or the client's disconnect, whichever comes first: whether `work`
    is done (the caller cleans up after it when not)."""
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    return work.done()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _sse_events(
    stream: RequestStream, head: ot.ReplyHead, chat: bool, resumed: bool,
    prompt_ids: list[int] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE answer; `prompt_ids` (`return_token_ids`): a chunk per token listing its id
    (empty text while the text is held back) and the first the prompt's, as vLLM 0.32 does
    (chat: at the top level of the role chunk; completions: in the first chunk's choice)."""
    final: StepOutput | None = None
    ids = prompt_ids is not None
    async with stream:
        if chat and not resumed:  # a continuation's client had the role delta from P's token
            opening = head.chunk(chat, [ot.stream_choice(chat, None, first=True)])
            if ids:
                opening["prompt_token_ids"], prompt_ids = prompt_ids, None
            yield ot.sse(opening)
        try:
            async for out in stream:
                final = out
                if not out.text and out.finish_reason is None and not (
                        ids and out.new_token_ids):
                    continue  # a chunk of ids alone only when they are asked for
                chunk = head.chunk(chat, [ot.stream_choice(chat, out, token_ids=ids)])
                if prompt_ids is not None:
                    chunk["choices"][0]["prompt_token_ids"], prompt_ids = prompt_ids, None
                if out.kv_transfer_params is not None:
                    chunk["kv_transfer_params"] = out.kv_transfer_params
                yield ot.sse(chunk)
        except EngineError as e:
            yield b"data: " + ot.error_body(str(e), e.error_type, e.status) + b"\n\n"
    if final is not None and head.include_usage:
        yield ot.sse({**head.chunk(chat, []), "usage": ot.usage(final)})
    yield ot.SSE_DONE


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the engine stream however the response ends. Starlette does not close the body
    iterator when the client disconnects (the send fails in its frame, not ours), so without
    this an abandoned stream would hold its KV blocks until garbage collection."""

    def __init__(self, stream: RequestStream, content: AsyncIterator[bytes], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._engine_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine_stream.close()


def _check_token_ids(engine: Engine, ids: list[int], param: str = "prompt") -> list[int]:
    vocab = engine.model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ot.RequestError(f"token ids out of range [0, {vocab}): {bad[:8]}", param=param)
    return ids


def _json(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, headers=headers,
                    media_type="application/json")


async def _request_error(request: Request, exc: ot.RequestError) -> Response:
    return Response(ot.error_body(exc.message, exc.error_type, exc.status, exc.param),
                    status_code=exc.status, media_type="application/json")


async def _engine_error(request: Request, exc: EngineError) -> Response:
    if exc.status >= 500:
        log.warning("request failed: %s", exc)
    return Response(ot.error_body(str(exc), exc.error_type, exc.status),
                    status_code=exc.status, media_type="application/json")
