"""The engine error map: every failure of an engine leg, as one error of `router.errors`.

One table for every leg, with the engine URL in the message (tests/router/test_engine_errors.py
checks it row by row):

    connect refused / DNS / no route       -> EngineUnavailable (connect_failed=True)
    connection reset / server disconnected -> EngineUnavailable
    deadline passed                        -> EngineTimeout
    5xx, 3xx, an SSE error event first     -> EngineError
    a 2xx that is not the protocol         -> EngineProtocolError (router/engines/replies.py)
    an answer to another request           -> EngineProtocolError (`answered_another`)
    a reply or SSE line over its limit     -> EngineReplyTooLarge
    4xx the router's request caused        -> EngineMisconfigured (see `_router_caused`)
    any other 4xx                          -> EngineRejected (engine's status, message, param)
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from pdgate.router.engines.http11 import BadResponse, ConnectFailed, Dropped, HTTPClientError
from pdgate.router.errors import (
    EngineError,
    EngineMisconfigured,
    EngineProtocolError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    RouterError,
)

__all__ = ["COMPLETION_ROUTES", "check_status", "engine_message", "not_the_protocol",
           "translate"]

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode

# Routes every engine must serve: a 404/405 there is a misconfigured engine, not a client
# error. The KV routes (/v1/kv/*) are optional: a 404 there selects a fallback flow.
COMPLETION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
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
# A field name or path (`messages.0.content`); an engine's longer `param` is cut.
_MAX_PARAM = 200


def engine_message(raw: bytes) -> str:
    """Best-effort error text from an engine reply (vLLM or FastAPI shapes)."""
    return _engine_error(raw)[0]


def _engine_error(raw: bytes) -> tuple[str, str, str | None]:
    """(message, what names the culprit: the message plus `param` or FastAPI's `loc`s,
    the field an OpenAI-shaped error names in `param`)."""
    try:
        obj = _json_decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = str(err["message"])
            param = err.get("param")
            param = param[:_MAX_PARAM] if isinstance(param, str) else None
            return message, f"{message} {param or ''}", param
        for key in ("message", "detail"):
            if isinstance(obj.get(key), str):
                return str(obj[key]), str(obj[key]), None
        detail = obj.get("detail")
        if isinstance(detail, list):  # FastAPI 422: [{loc, msg, input}] (`input` is the
            parts = [_validation_error(d) for d in detail[:8] if isinstance(d, dict)]
            if parts:  # client's, so left out)
                return "; ".join(parts), " ".join(parts), None
    text = raw[:200].decode("utf-8", "replace")
    return text, text, None


def _validation_error(d: dict[str, Any]) -> str:
    loc = d.get("loc")
    where = ".".join(map(str, loc)) if isinstance(loc, list) else ""
    return f"{where}: {d.get('msg')}"


def check_status(url: str, path: str, status: int, raw: bytes, sent: bytes) -> None:
    """Raise the error for a non-2xx reply to the leg `sent` to `url + path`."""
    if status < 300:
        return
    if status < 400:  # redirects are never followed: an engine URL is used as configured
        raise EngineError(f"engine {url} answered HTTP {status} (redirects are not followed)")
    message, culprit, param = _engine_error(raw)
    if status >= 500:
        raise EngineError(f"engine {url} returned HTTP {status}: {message}")
    why = _router_caused(path, status, culprit, sent)
    if why is not None:
        exc = EngineMisconfigured(f"engine {url} refused the router's request to {path} "
                                  f"({why}): HTTP {status}: {message}")
        exc.engine_status = status
        raise exc
    raise EngineRejected(message, status=status, param=param)


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
        return "it does not serve this route" if path in COMPLETION_ROUTES else None
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
    if path in COMPLETION_ROUTES:
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


def not_the_protocol(url: str, path: str, why: str) -> EngineProtocolError:
    return EngineProtocolError(f"engine {url} sent a reply to {path} that is not the "
                               f"protocol: {why}")


class translate:  # noqa: N801 -- used like a function: `with translate(url, what):`
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
