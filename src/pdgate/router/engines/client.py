"""The engine client: vLLM's HTTP API over pooled HTTP/1.1 connections, for every engine leg.

The only user of the HTTP client (router/engines/http11.py). Its neighbours do the rest of
the edge: router/engines/error_map.py maps every failure into the `router.errors` tree,
router/engines/replies.py checks and decodes every reply (typed, contract/engine_replies.py)
and matches it to the request it answers, router/engines/stream.py checks a decode stream.

The protocol, checked on every reply: a non-streaming 2xx body is one JSON object (with a
`choices` list on the completion routes) of at most `max_engine_reply_bytes`, checked by
Content-Length before reading and while reading; a stream is `text/event-stream` whose
lines pass `router.sse.EventChecker` (JSON-object or `[DONE]` data events, lines of at most
`max_sse_line_bytes`, `[DONE]` before the end). Error bodies are read up to 64 KiB only.
Every request carries the router's internal request id (`X-Request-Id`, from the caller's
headers); an answer naming another request is refused (`replies.AnswerMismatch`, a 502).

The client is router/engines/http11.py (asyncio Protocols and httptools' parser, keep-alive
connections pooled per engine, TCP_NODELAY): httpx's pool scans every pooled connection on
each request and collapses under concurrency, and aiohttp's client cost more CPU per leg
than the rest of the router together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

from pdgate.contract.engine_replies import KVInfo, KVReservation, ModelList
from pdgate.router.config import RouterConfig
from pdgate.router.engines.error_map import check_status, translate
from pdgate.router.engines.http11 import ConnectionPool, HTTPClientError, Response
from pdgate.router.engines.replies import (
    AnswerMismatch,
    PrefillReply,
    check_reply,
    decode_kv_info,
    decode_models,
    decode_prefill,
    decode_reservation,
    header_id,
)
from pdgate.router.engines.stream import EngineStream, RefusalListener, StreamListener
from pdgate.router.errors import (
    EngineProtocolError,
    EngineRejected,
    EngineReplyTooLarge,
    RouterError,
)

__all__ = ["EngineClient", "EngineStream", "StreamListener"]

T = TypeVar("T")
_json_encode = msgspec.json.Encoder().encode
_ERROR_BODY_CAP = 64 * 1024  # of a non-2xx body: enough for any message we show
_MODELS_CAP = 1 << 20  # of a /v1/models answer: thousands of adapters' cards
# vLLM's 400 to a load of an adapter it already holds (our view was a probe behind).
_ALREADY_LOADED = "has already been loaded"


def _deadline(seconds: float) -> float:
    """`seconds` from now on the loop's clock (the client's deadlines are absolute)."""
    return asyncio.get_running_loop().time() + seconds


def _request_id(headers: Mapping[str, str]) -> str | None:
    return headers.get("X-Request-Id")


def _check_echo(url: str, what: str, echoed: str | None, request_id: str | None) -> None:
    """An echoed `X-Request-Id` (the shim's) must be the one sent, exactly."""
    if echoed is not None and request_id is not None and echoed != request_id:
        raise AnswerMismatch(f"engine {url} answered another request ({what} {echoed!r}, "
                             f"sent {request_id!r})")


async def _read_body(url: str, resp: Response, limit: int, *, deadline: float | None = None,
                     per_read_s: float | None = None) -> bytes:
    """The whole 2xx body, refused (`EngineReplyTooLarge`, connection closed) as soon as it
    is known to exceed `limit` bytes: by Content-Length before reading, else while reading.
    Each read waits until `deadline`, or `per_read_s` from its start. Holds the pieces and
    joins them once. The caller releases `resp`."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        resp.close()
        raise EngineReplyTooLarge(f"engine {url} sent a {declared}-byte reply; the limit "
                                  f"is {limit} bytes")
    pieces: list[bytes] = []
    size = 0
    while piece := await resp.read_some(deadline if per_read_s is None
                                        else _deadline(per_read_s)):
        size += len(piece)
        if size > limit:
            resp.close()
            raise EngineReplyTooLarge(f"engine {url} sent a reply over the {limit}-byte limit")
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def _read_capped(resp: Response, deadline: float | None,
                       cap: int = _ERROR_BODY_CAP) -> bytes:
    """At most `cap` bytes of a body we only show part of (an error, a health reply); the
    connection is closed instead of reading a longer body to its end. Releases `resp`."""
    pieces: list[bytes] = []
    size = 0
    try:
        while size < cap and (piece := await resp.read_some(deadline)):
            pieces.append(piece)
            size += len(piece)
    finally:
        resp.release()  # back to the pool only if the body was read to its end
    return b"".join(pieces)[:cap]


class EngineClient:
    """HTTP client for engine legs: one pool of keep-alive connections per router app.

    Deadlines (seconds, from `RouterConfig`): connect; prefill total; decode first byte
    (response headers); decode idle (gap between body chunks).
    """

    def __init__(self, pool: ConnectionPool, config: RouterConfig) -> None:
        self._pool = pool
        self._cfg = config
        self._stream_listener: StreamListener | None = None
        self._on_refused: RefusalListener | None = None

    def set_stream_listener(self, listener: StreamListener | None) -> None:
        """Who hears how each decode stream ended (the app wires the engines' breakers)."""
        self._stream_listener = listener

    def set_refusal_listener(self, listener: RefusalListener | None) -> None:
        """Who hears of each answer refused for answering another request (a counter)."""
        self._on_refused = listener

    def set_discard_listener(self, listener: Callable[[str], None] | None) -> None:
        """Who hears the reason of each engine connection closed for bytes past a
        response's framing (`http11.DISCARD_REASONS`; a counter)."""
        self._pool.set_discard_listener(listener)

    def refused(self, reason: str) -> None:
        """Count one refused engine answer (also called by the flows' own checks)."""
        if self._on_refused is not None:
            self._on_refused(reason)

    @property
    def first_byte_timeout_s(self) -> float:
        """Seconds a decode engine may take to send its first byte (see `check_start`)."""
        return self._cfg.decode_first_byte_timeout_s

    @classmethod
    def create(cls, config: RouterConfig) -> EngineClient:
        """Build the connection pool; must run on the event loop that will use it."""
        # The engine key rides on every call (legs, health probes, KV aborts, reservations).
        # No Accept-Encoding: bodies are relayed and checked as sent, never decompressed,
        # so an engine (or a proxy before it) must not be invited to compress them.
        auth = f"Authorization: Bearer {config.engine_api_key}" \
            if config.engine_api_key else None
        # Keep-alive below uvicorn's (and so vLLM's) 5 s, so we drop idle connections
        # before the engine does and never send on a half-closed one.
        pool = ConnectionPool(limit=config.max_connections,
                              keepalive_s=config.engine_keepalive_s, auth_header=auth)
        return cls(pool, config)

    async def close(self) -> None:
        """Close every pooled connection."""
        await self._pool.close()

    async def prefill(self, url: str, path: str, body: bytes,
                      headers: Mapping[str, str]) -> PrefillReply:
        """POST a non-streaming prefill leg; P's reply decoded, checked and matched to the
        request (`replies.decode_prefill`). One deadline (the prefill timeout) bounds the
        whole exchange."""
        rid = _request_id(headers)

        def check(raw: bytes, echoed: str | None) -> PrefillReply:
            _check_echo(url, "X-Request-Id", echoed, rid)
            return decode_prefill(url, path, raw, rid)

        return await self._post(url, path, body, headers, check, "prefill",
                                _deadline(self._cfg.prefill_timeout_s), None)

    async def kv_info(self, url: str, headers: Mapping[str, str]) -> KVInfo:
        """`POST /v1/kv/info`: the engine's NIXL identity (a 404: not a shim)."""
        path = "/v1/kv/info"
        return await self._post(url, path, b"{}", headers,
                                lambda raw, _: decode_kv_info(url, path, raw), "prefill",
                                _deadline(self._cfg.prefill_timeout_s), None)

    async def kv_reserve(self, url: str, request_id: str, num_tokens: int,
                         headers: Mapping[str, str]) -> KVReservation:
        """`POST /v1/kv/reserve`: blocks on D for `num_tokens` prompt tokens."""
        path = "/v1/kv/reserve"
        body = _json_encode({"request_id": request_id, "num_tokens": num_tokens})
        return await self._post(url, path, body, headers,
                                lambda raw, _: decode_reservation(url, path, raw), "prefill",
                                _deadline(self._cfg.prefill_timeout_s), None)

    async def post_raw(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> bytes:
        """POST a non-streaming decode request; return the 2xx body bytes (checked as
        `replies.check_reply` says, relayed as the engine sent them). The engine answers
        only when generation is done, so one read deadline (first byte) bounds the header
        wait and each body read."""
        rid = _request_id(headers)

        def check(raw: bytes, echoed: str | None) -> bytes:
            _check_echo(url, "X-Request-Id", echoed, rid)
            check_reply(url, path, raw, rid)
            return raw

        return await self._post(url, path, body, headers, check, "decode", None,
                                self._cfg.decode_first_byte_timeout_s)

    async def forward(self, url: str, method: str, path: str, body: bytes | None,
                      headers: Mapping[str, str]) -> Response:
        """Send a pass-through request (router/http/passthrough.py: embeddings, tokenize,
        ...) and return the engine's response once its headers arrived, whatever its
        status: the caller reads the body (with `translate`) and releases it. Connect and
        headers within the decode first-byte deadline."""
        with translate(url, "pass-through"):
            first = _deadline(self._cfg.decode_first_byte_timeout_s)
            connect = min(first, _deadline(self._cfg.connect_timeout_s))
            return await self._pool.request(method, url, path, body, headers,
                                            connect_deadline=connect, deadline=first)

    def _matched(self, check: Callable[..., T], *args: Any) -> T:
        """`check(*args)`, counting an `AnswerMismatch` it raises."""
        try:
            return check(*args)
        except AnswerMismatch as exc:
            self.refused(exc.reason)
            raise

    async def _post(self, url: str, path: str, body: bytes, headers: Mapping[str, str],
                    check: Callable[[bytes, str | None], T], what: str, total: float | None,
                    per_read_s: float | None) -> T:
        """`check(body, echoed X-Request-Id)` of the 2xx reply to a non-streaming POST,
        read within `max_engine_reply_bytes`. The connection goes back to the pool only
        after `check` passed: an answer refused (e.g. to another request) closes it."""
        with translate(url, what):
            connect = _deadline(self._cfg.connect_timeout_s)
            if total is not None:
                connect = min(connect, total)
            first = total if per_read_s is None else _deadline(per_read_s)
            resp = await self._pool.request("POST", url, path, body, headers,
                                            connect_deadline=connect, deadline=first)
            try:
                if resp.status >= 300:
                    raw = await _read_capped(resp, first if per_read_s is None
                                             else _deadline(per_read_s))
                    check_status(url, path, resp.status, raw, body)
                raw = await _read_body(url, resp, self._cfg.max_engine_reply_bytes,
                                       deadline=total, per_read_s=per_read_s)
                try:  # not through _matched: one call less on every answer
                    result = check(raw, header_id(resp.headers))
                except AnswerMismatch as exc:
                    self.refused(exc.reason)
                    raise
                resp.release()
            finally:
                resp.close()  # no-op once released
        return result

    async def open_stream(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> EngineStream:
        """POST a streaming decode request and wait for a 2xx `text/event-stream` status
        line (connect and headers within the first-byte deadline).

        Non-2xx replies are read (64 KiB at most), closed and raised; another content type
        raises `EngineProtocolError` (e.g. a JSON answer to a streaming request). The caller
        owns the returned stream.
        """
        cfg = self._cfg
        rid = _request_id(headers)
        with translate(url, "decode first byte"):
            first = _deadline(cfg.decode_first_byte_timeout_s)
            connect = min(first, _deadline(cfg.connect_timeout_s))
            resp = await self._pool.request("POST", url, path, body, headers,
                                            connect_deadline=connect, deadline=first)
            if resp.status >= 300:
                raw = await _read_capped(resp, _deadline(cfg.decode_idle_timeout_s))
                check_status(url, path, resp.status, raw, body)
            echoed = header_id(resp.headers)
            if echoed is not None and echoed != rid:  # checked here: no calls when it matches
                try:
                    self._matched(_check_echo, url, "X-Request-Id", echoed, rid)
                except AnswerMismatch:
                    resp.close()
                    raise
            if resp.content_type != "text/event-stream":
                resp.close()
                raise EngineProtocolError(
                    f"engine {url} answered a streaming request with Content-Type "
                    f"{resp.content_type!r}, not text/event-stream")
        return EngineStream(url, resp, cfg.decode_idle_timeout_s,
                            max_line_bytes=cfg.max_sse_line_bytes,
                            listener=self._stream_listener, request_id=rid,
                            on_refused=self._on_refused)

    async def abort_kv(self, url: str, request_id: str, timeout_s: float, *,
                       write_possible: bool = True) -> str:
        """Best effort: ask engine `url` to free the KV blocks it holds for `request_id`
        (`POST /v1/kv/abort`, served by engine_shim; see router/aborts.py). Never raises;
        returns "ok", "unsupported" (404/405: e.g. vLLM has no such route) or "failed"."""
        payload: dict[str, Any] = {"request_id": request_id}
        if not write_possible:
            payload["write_possible"] = False
        body = _json_encode(payload)
        try:
            status = await self._status_of("POST", url, "/v1/kv/abort", body,
                                           {"Content-Type": "application/json",
                                            "X-Request-Id": request_id}, timeout_s)
        except (HTTPClientError, TimeoutError):
            return "failed"
        if 200 <= status < 300:
            return "ok"
        return "unsupported" if status in (404, 405) else "failed"

    async def health(self, url: str) -> bool:
        """True when `GET {url}/health` answers 2xx within the health timeout."""
        try:
            status = await self._status_of("GET", url, "/health", None, {},
                                           self._cfg.health_timeout_s)
        except (HTTPClientError, TimeoutError):
            return False
        return 200 <= status < 300

    async def metrics_page(self, url: str) -> bytes | None:
        """`GET {url}/metrics` (its first MiB, within the health timeout); None when it
        fails or is not 2xx. Read for a vLLM engine's DP size (router/dp_learn.py)."""
        deadline = _deadline(self._cfg.health_timeout_s)
        try:
            resp = await self._pool.request("GET", url, "/metrics", None, {},
                                            connect_deadline=deadline, deadline=deadline)
            body = await _read_capped(resp, deadline, 1 << 20)
        except (HTTPClientError, TimeoutError):
            return None
        return body if 200 <= resp.status < 300 else None

    async def models(self, url: str) -> ModelList | None:
        """`GET {url}/v1/models` (its first MiB, within the health timeout), decoded: the
        base model and the LoRA adapters the engine holds. None when it fails, is not 2xx
        or is not a model list (the caller keeps what it knew)."""
        deadline = _deadline(self._cfg.health_timeout_s)
        try:
            resp = await self._pool.request("GET", url, "/v1/models", None, {},
                                            connect_deadline=deadline, deadline=deadline)
            body = await _read_capped(resp, deadline, _MODELS_CAP)
            if not 200 <= resp.status < 300:
                return None
            return decode_models(url, body)
        except (HTTPClientError, TimeoutError, RouterError):
            return None

    async def load_lora_adapter(self, url: str, name: str, path: str,
                                timeout_s: float) -> None:
        """`POST {url}/v1/load_lora_adapter` (vLLM; its server needs
        `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, else the route is a 404): load adapter
        `name` from `path`. Returns once the engine holds it (also when it already did);
        raises the `RouterError` of the failure (`translate`, `check_status`)."""
        body = _json_encode({"lora_name": name, "lora_path": path})
        try:
            await self._post(url, "/v1/load_lora_adapter", body,
                             {"Content-Type": "application/json"}, lambda raw, _: None,
                             "adapter load", _deadline(timeout_s), None)
        except EngineRejected as exc:
            if exc.status != 400 or _ALREADY_LOADED not in exc.message:
                raise

    async def _status_of(self, method: str, url: str, path: str, body: bytes | None,
                         headers: Mapping[str, str], timeout_s: float) -> int:
        """The status of one request whose body is read (capped) and dropped; every step
        within `timeout_s` in all."""
        deadline = _deadline(timeout_s)
        resp = await self._pool.request(method, url, path, body, headers,
                                        connect_deadline=deadline, deadline=deadline)
        await _read_capped(resp, deadline)
        return resp.status
