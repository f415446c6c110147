"""The engine adapter: vLLM's HTTP API and NIXL `kv_transfer_params` contract, over HTTP/1.1.

This is the only module that knows vLLM field names (`kv_transfer_params`, `min_tokens`, …)
and the only user of the HTTP client (router/engines/http11.py). Every transport failure, and
every reply that is not the protocol, is translated here into the `router.errors` tree, with
the engine URL in the message:

    connect refused / DNS / no route       -> EngineUnavailable (connect_failed=True)
    connection reset / server disconnected -> EngineUnavailable
    deadline passed                        -> EngineTimeout
    5xx, 3xx, an SSE error event first     -> EngineError
    a 2xx that is not the protocol         -> EngineProtocolError (see below)
    a reply or SSE line over its limit     -> EngineReplyTooLarge
    4xx the router's request caused        -> EngineMisconfigured (see `_router_caused`)
    any other 4xx                          -> EngineRejected (engine's status and message)

The protocol, checked on every reply: a non-streaming 2xx body is one JSON object (with a
`choices` list on the completion routes) of at most `max_engine_reply_bytes`, checked by
Content-Length before reading and while reading; a stream is `text/event-stream` whose
lines pass `router.sse.EventChecker` (JSON-object or `[DONE]` data events, lines of at most
`max_sse_line_bytes`, `[DONE]` before the end). Error bodies are read up to 64 KiB only.

The client is router/engines/http11.py (asyncio Protocols and httptools' parser, keep-alive
connections pooled per engine, TCP_NODELAY): httpx's pool scans every pooled connection on
each request and collapses under concurrency, and aiohttp's client cost more CPU per leg
than the rest of the router together.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from pdgate.router.config import RouterConfig
from pdgate.router.engines.http11 import (
    BadResponse,
    ConnectFailed,
    ConnectionPool,
    Dropped,
    HTTPClientError,
    Response,
)
from pdgate.router.engines.sse import EventChecker, SSELineTooLong, SSEProtocolError
from pdgate.router.errors import (
    EngineError,
    EngineMisconfigured,
    EngineProtocolError,
    EngineRejected,
    EngineReplyTooLarge,
    EngineTimeout,
    EngineUnavailable,
    RouterError,
)

__all__ = [
    "EngineClient",
    "EngineStream",
    "PrefillUsage",
    "StreamListener",
    "extract_kv_params",
    "prefill_usage",
    "rewrite_usage",
]

log = logging.getLogger(__name__)
_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_SSE_ERROR = b'data: {"error"'
_ERROR_BODY_CAP = 64 * 1024  # of a non-2xx body: enough for any message we show
# Routes every engine must serve: a 404/405 there is a misconfigured engine, not a client
# error. The KV routes (/v1/kv/*) are optional: a 404 there selects a fallback flow.
_COMPLETION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
# 4xx that only the router's own request can cause (its credentials, its headers, its
# connection), whatever the client sent.
_ROUTER_STATUSES = {
    401: "the engine refused the router's credentials",
    403: "the engine refused the router's credentials",
    407: "a proxy in front of the engine wants credentials",
    421: "the engine says the request reached the wrong server",
    426: "the engine wants another protocol",
    431: "the engine refused the router's request headers",
}
# Keys the router (or P, through the router) puts in `kv_transfer_params`: vLLM's
# NixlConnector and pdgate's extension (router/flows_*.py, engine_shim/kv_params.py).
# An engine 400/422 naming one (even one that is missing) blames the router or P.
_KV_PARAM_KEYS = frozenset({
    "kv_transfer_params", "do_remote_decode", "do_remote_prefill", "remote_engine_id",
    "remote_block_ids", "remote_host", "remote_port", "remote_request_id",
    "remote_agent_name", "tp_size", "pdgate_mode", "notify_endpoint", "notify_request_id",
    "notify_token", "reservation_id", "num_tokens", "write_deadline", "first_token_ids",
    "continue_after_prefill", "push_deadline",
})
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Object(msgspec.Struct):
    """Any JSON object (fields skipped, not built): the check of a non-completion reply."""


class _Completion(msgspec.Struct):
    """A completion reply, as far as the router relies on it."""

    choices: list[msgspec.Raw]


_check_object = msgspec.json.Decoder(_Object).decode
_check_completion = msgspec.json.Decoder(_Completion).decode

def extract_kv_params(reply: Mapping[str, Any]) -> Any | None:
    """P's `kv_transfer_params`, or None when P sent none (then decode must recompute)."""
    params = reply.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None


@dataclass(frozen=True, slots=True)
class PrefillUsage:
    """The prompt side of billing, as P counted it."""

    prompt_tokens: int
    prompt_tokens_details: Any | None


def prefill_usage(reply: Mapping[str, Any]) -> PrefillUsage | None:
    """Usage from P's reply, or None when P reported none."""
    usage = reply.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        return None
    return PrefillUsage(usage["prompt_tokens"], usage.get("prompt_tokens_details"))


def rewrite_usage(usage: dict[str, Any], prefill: PrefillUsage) -> None:
    """Make a decode usage object bill right: prompt side from P, completion from D."""
    usage["prompt_tokens"] = prefill.prompt_tokens
    usage["prompt_tokens_details"] = prefill.prompt_tokens_details
    completion = usage.get("completion_tokens")
    completion = completion if isinstance(completion, int) else 0
    usage["total_tokens"] = prefill.prompt_tokens + completion


def _engine_message(raw: bytes) -> str:
    """Best-effort error text from an engine reply (vLLM or FastAPI shapes)."""
    return _engine_error(raw)[0]


def _engine_error(raw: bytes) -> tuple[str, str]:
    """(message, what names the culprit: the message plus `param` or FastAPI's `loc`s)."""
    try:
        obj = _json_decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = str(err["message"])
            return message, f"{message} {err.get('param') or ''}"
        for key in ("message", "detail"):
            if isinstance(obj.get(key), str):
                return str(obj[key]), str(obj[key])
        detail = obj.get("detail")
        if isinstance(detail, list):  # FastAPI 422: [{loc, msg, input}] (`input` is the
            parts = [_validation_error(d) for d in detail[:8] if isinstance(d, dict)]
            if parts:  # client's, so left out)
                return "; ".join(parts), " ".join(parts)
    text = raw[:200].decode("utf-8", "replace")
    return text, text


def _validation_error(d: dict[str, Any]) -> str:
    loc = d.get("loc")
    where = ".".join(map(str, loc)) if isinstance(loc, list) else ""
    return f"{where}: {d.get('msg')}"


def _check_status(url: str, path: str, status: int, raw: bytes, sent: bytes) -> None:
    """Raise the error for a non-2xx reply to the leg `sent` to `url + path`."""
    if status < 300:
        return
    if status < 400:  # redirects are never followed: an engine URL is used as configured
        raise EngineError(f"engine {url} answered HTTP {status} (redirects are not followed)")
    message, culprit = _engine_error(raw)
    if status >= 500:
        raise EngineError(f"engine {url} returned HTTP {status}: {message}")
    why = _router_caused(path, status, culprit, sent)
    if why is not None:
        raise EngineMisconfigured(f"engine {url} refused the router's request to {path} "
                                  f"({why}): HTTP {status}: {message}")
    raise EngineRejected(message, status=status)


def _router_caused(path: str, status: int, culprit: str, sent: bytes) -> str | None:
    """Why a 4xx is the engine's or the router's fault rather than the client's, or None.

    - 401/403/407/421/426/431: credentials, headers and connection are the router's;
    - 404/405 on a completion route: the engine does not serve what it must (or serves
      another model: the router already checked the client's model name);
    - 400/422 whose message or `param` names a field the router added (`kv_transfer_params`
      and its keys, every field of a `/v1/kv/*` body) that the client's part of the request
      never mentions: a client cannot get its own 4xx counted against an engine by putting
      such a name in a prompt or a value the engine echoes back.
    """
    if status in _ROUTER_STATUSES:
        return _ROUTER_STATUSES[status]
    if status in (404, 405):
        return "it does not serve this route" if path in _COMPLETION_ROUTES else None
    if status not in (400, 422):
        return None
    named = set(_WORD.findall(culprit))
    if not named:
        return None
    try:
        body = _json_decode(sent)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    if path in _COMPLETION_ROUTES:
        params = body.pop("kv_transfer_params", None)
        ours = set(_KV_PARAM_KEYS)
        if isinstance(params, dict):
            ours.update(k for k in params if isinstance(k, str))
        clients = _json_encode(body)
    else:  # a KV route: the router wrote the whole body
        ours, clients = {k for k in body if isinstance(k, str)}, b""
    for name in sorted(named & ours):
        if name.encode() not in clients:
            return f"it names `{name}`, which the router added"
    return None


def _deadline(seconds: float) -> float:
    """`seconds` from now on the loop's clock (the client's deadlines are absolute)."""
    return asyncio.get_running_loop().time() + seconds


async def _read_body(url: str, resp: Response, limit: int, *, deadline: float | None = None,
                     per_read_s: float | None = None) -> bytes:
    """The whole 2xx body, refused (`EngineReplyTooLarge`, connection closed) as soon as it
    is known to exceed `limit` bytes: by Content-Length before reading, else while reading.
    Each read waits until `deadline`, or `per_read_s` from its start. Holds the pieces and
    joins them once."""
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
    resp.release()
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


def _check_reply(url: str, path: str, raw: bytes) -> None:
    """Raise `EngineProtocolError` unless `raw` is a UTF-8 JSON object (with a `choices`
    list on the completion routes). Skips values instead of building them."""
    try:
        if not raw.isascii():
            _check_utf8(raw)  # the skipping decoders below do not look inside strings
        if path in _COMPLETION_ROUTES:
            _check_completion(raw)
        else:
            _check_object(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError,
            RecursionError) as exc:  # msgspec: nesting past the interpreter's budget
        raise _not_the_protocol(url, path, str(exc)) from None


def _check_utf8(raw: bytes, step: int = 1 << 20) -> None:
    """Raise `UnicodeDecodeError` unless `raw` is UTF-8, decoding 1 MiB at a time (a whole
    64 MiB reply at once would briefly take up to four times that as a str)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    for i in range(0, len(raw), step):
        decoder.decode(view[i:i + step])
    decoder.decode(b"", final=True)


def _decode_reply(url: str, path: str, raw: bytes) -> dict[str, Any]:
    """`raw` decoded, with the checks of `_check_reply` (one decode: P's reply is used)."""
    try:
        obj = _json_decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise _not_the_protocol(url, path, str(exc)) from None
    if not isinstance(obj, dict):
        raise _not_the_protocol(url, path, f"JSON {type(obj).__name__}, not an object")
    if path in _COMPLETION_ROUTES and not isinstance(obj.get("choices"), list):
        raise _not_the_protocol(url, path, "no `choices` list")
    return obj


def _not_the_protocol(url: str, path: str, why: str) -> EngineProtocolError:
    return EngineProtocolError(f"engine {url} sent a reply to {path} that is not the "
                               f"protocol: {why}")


class _translate:  # noqa: N801 -- used like the function it was: `with _translate(...)`
    """Map the HTTP client's failures raised in the block to `RouterError`s. (A class:
    a generator-based context manager costs a generator and two frames per leg.)"""

    __slots__ = ("_url", "_what")

    def __init__(self, url: str, what: str) -> None:
        self._url, self._what = url, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is None or isinstance(exc, RouterError):
            return
        url = self._url
        if isinstance(exc, TimeoutError):  # every deadline of the client
            raise EngineTimeout(f"engine {url} timed out ({self._what})") from None
        if isinstance(exc, ConnectFailed):
            raise EngineUnavailable(f"cannot connect to engine {url}: {exc}",
                                    connect_failed=True) from None
        if isinstance(exc, Dropped):
            raise EngineUnavailable(f"engine {url} dropped the connection: {exc}") from None
        if isinstance(exc, (BadResponse, HTTPClientError)):
            raise EngineError(f"engine {url} request failed: {exc}") from None


StreamListener = Callable[[str, RouterError | None], None]
"""Told `(engine url, None)` when a decode stream ended as the protocol says, or `(engine
url, error)` when it failed after it was handed out (mid-stream: garbage, an over-long
line, a drop, an idle timeout). Failures `open_stream`/`check_start` raise are not
reported here: the caller that gets the exception records them (the orchestrator's retry).
"""


class EngineStream:
    """An open streaming response from an engine (status already checked as 2xx).

    Iterate `chunks()` for the body as it arrives, in whole SSE lines checked by
    `router.sse.EventChecker` (a partial line is held back until its newline); a
    violation raises `EngineProtocolError` / `EngineReplyTooLarge`. Always call `close()`
    (idempotent). A stream read to the end returns its connection to the pool; one closed
    early drops it.
    """

    def __init__(self, url: str, resp: Response, idle_timeout_s: float, *,
                 max_line_bytes: int, listener: StreamListener | None = None) -> None:
        self._url = url
        self._resp = resp
        self._idle = idle_timeout_s
        self._checker = EventChecker(max_line_bytes)
        self._listener = listener
        self._eof = False  # the body was read to its end
        self._first = b""  # read by `check_start`, handed out first by `chunks`

    async def check_start(self, timeout_s: float) -> None:
        """Read up to the first complete line (within `timeout_s`) and raise `EngineError`
        if it is an SSE error event, `EngineProtocolError` if it breaks the protocol. vLLM
        answers a stream it cannot even start (e.g. a decode engine given KV params it
        cannot use) with HTTP 200 and one error event; checking here keeps that failure
        retryable and lets the client get a 502 instead of a 200 with an error inside. On
        any exception the stream is closed."""
        try:
            deadline = _deadline(timeout_s)
            with _translate(self._url, "decode first byte"):
                while not self._first and not self._eof:
                    self._first = self._accept(await self._resp.read_some(deadline))
            if self._first.startswith(_SSE_ERROR):
                event = self._first[len(b"data: "):].split(b"\n", 1)[0]
                raise EngineError(f"engine {self._url} failed the stream: "
                                  f"{_engine_message(event)}")
        except BaseException:
            self.close()
            raise

    async def chunks(self) -> AsyncIterator[bytes]:
        """Checked body bytes as received; each wait is bounded by the idle timeout. Tells
        the listener how the stream ended (not when the reader stops early)."""
        try:
            if self._first:
                first, self._first = self._first, b""
                yield first
            resp, loop = self._resp, asyncio.get_running_loop()
            while not self._eof:
                with _translate(self._url, "stream idle"):
                    raw = await resp.read_some(loop.time() + self._idle)
                if out := self._accept(raw):
                    yield out
        except RouterError as exc:
            self._tell(exc)
            if not self._checker.done:
                raise
            # The reader has its [DONE]: end its stream cleanly; `close` drops the connection.
            log.warning("%s (after [DONE]: the stream ends normally)", exc.message)
            return
        self._tell(None)

    def _accept(self, raw: bytes) -> bytes:
        """Check one read (b"": end of body); the complete lines to hand out."""
        try:
            if raw:
                return self._checker.feed(raw)
            self._eof = True
            return self._checker.end()
        except SSELineTooLong as exc:
            raise EngineReplyTooLarge(f"engine {self._url}: {exc}") from None
        except SSEProtocolError as exc:
            raise EngineProtocolError(f"engine {self._url} broke the SSE protocol: "
                                      f"{exc}") from None

    def _tell(self, error: RouterError | None) -> None:
        if self._listener is not None:
            self._listener(self._url, error)

    def close(self) -> None:
        """Release the upstream connection (to the pool if fully read, else closed)."""
        if self._eof:
            self._resp.release()
        else:
            self._resp.close()


class EngineClient:
    """HTTP client for engine legs: one pool of keep-alive connections per router app.

    Deadlines (seconds, from `RouterConfig`): connect; prefill total; decode first byte
    (response headers); decode idle (gap between body chunks).
    """

    def __init__(self, pool: ConnectionPool, config: RouterConfig) -> None:
        self._pool = pool
        self._cfg = config
        self._stream_listener: StreamListener | None = None

    def set_stream_listener(self, listener: StreamListener | None) -> None:
        """Who hears how each decode stream ended (the app wires the engines' breakers)."""
        self._stream_listener = listener

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

    async def post_json(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        """POST a non-streaming prefill (or KV-route) request; return the decoded JSON
        object (a 2xx that is not one raises `EngineProtocolError`). One deadline (the
        prefill timeout) bounds the whole exchange."""
        total = _deadline(self._cfg.prefill_timeout_s)
        raw = await self._post(url, path, body, headers, "prefill", total, None)
        return _decode_reply(url, path, raw)

    async def post_raw(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> bytes:
        """POST a non-streaming decode request; return the 2xx body bytes (checked as
        `_check_reply` says, relayed as the engine sent them). The engine answers only
        when generation is done, so one read deadline (first byte) bounds the header wait
        and each body read."""
        raw = await self._post(url, path, body, headers, "decode", None,
                               self._cfg.decode_first_byte_timeout_s)
        _check_reply(url, path, raw)
        return raw

    async def _post(self, url: str, path: str, body: bytes, headers: Mapping[str, str],
                    what: str, total: float | None, per_read_s: float | None) -> bytes:
        """The 2xx body of a non-streaming POST, read within `max_engine_reply_bytes`."""
        with _translate(url, what):
            connect = _deadline(self._cfg.connect_timeout_s)
            if total is not None:
                connect = min(connect, total)
            first = total if per_read_s is None else _deadline(per_read_s)
            resp = await self._pool.request("POST", url, path, body, headers,
                                            connect_deadline=connect, deadline=first)
            try:
                status = resp.status
                if status >= 300:
                    raw = await _read_capped(resp, first if per_read_s is None
                                             else _deadline(per_read_s))
                else:
                    raw = await _read_body(url, resp, self._cfg.max_engine_reply_bytes,
                                           deadline=total, per_read_s=per_read_s)
            finally:
                resp.close()  # no-op once released
        _check_status(url, path, status, raw, body)
        return raw

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
        with _translate(url, "decode first byte"):
            first = _deadline(cfg.decode_first_byte_timeout_s)
            connect = min(first, _deadline(cfg.connect_timeout_s))
            resp = await self._pool.request("POST", url, path, body, headers,
                                            connect_deadline=connect, deadline=first)
            if resp.status >= 300:
                raw = await _read_capped(resp, _deadline(cfg.decode_idle_timeout_s))
                _check_status(url, path, resp.status, raw, body)
            if resp.content_type != "text/event-stream":
                resp.close()
                raise EngineProtocolError(
                    f"engine {url} answered a streaming request with Content-Type "
                    f"{resp.content_type!r}, not text/event-stream")
        return EngineStream(url, resp, cfg.decode_idle_timeout_s,
                            max_line_bytes=cfg.max_sse_line_bytes,
                            listener=self._stream_listener)

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

    async def _status_of(self, method: str, url: str, path: str, body: bytes | None,
                         headers: Mapping[str, str], timeout_s: float) -> int:
        """The status of one request whose body is read (capped) and dropped; every step
        within `timeout_s` in all."""
        deadline = _deadline(timeout_s)
        resp = await self._pool.request(method, url, path, body, headers,
                                        connect_deadline=deadline, deadline=deadline)
        await _read_capped(resp, deadline)
        return resp.status
