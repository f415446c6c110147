"""The router's error tree and its one mapping to an OpenAI-style error body.

Every failure the router reports to a client is a `RouterError`. Adapters translate foreign
exceptions at their edge (the engine client in `router/engines/error_map.py`, msgspec in
`api.py`), so the rest of the code only ever sees this tree::

    RouterError                      (500 InternalServerError — only for bugs we caught)
    ├── InvalidRequest               400 BadRequestError / invalid_request_error
    │   └── ContextLengthExceeded    400 ... code context_length_exceeded
    ├── ModelNotFound                404 NotFoundError / model_not_found
    ├── RouteNotFound                404 NotFoundError  (no route has this path)
    ├── MethodNotAllowed             405 BadRequestError  (the path's routes take other
    │                                    methods; `Allow` lists them)
    ├── PayloadTooLarge              413 BadRequestError / payload_too_large
    ├── RequestTimeout               408 BadRequestError / request_timeout  (slow body)
    ├── Unauthorized                 401 AuthenticationError / invalid_api_key
    ├── Overloaded                   429 RateLimitError / overloaded  (+ Retry-After)
    │   └── QuotaExceeded            429 ... rate_limit_exceeded  (the key's tokens per
    │                                    minute are used up; + Retry-After)
    ├── NoEndpointAvailable          503 ServiceUnavailableError / no_endpoint_available
    │   ├── AdapterUnavailable       503 ... adapter_unavailable  (no engine of a role
    │   │                                holds the LoRA adapter, none may be loaded)
    │   └── AdapterLoadFailed        503 ... adapter_load_failed  (loading it failed)
    ├── TooManyConnections           503 ServiceUnavailableError / too_many_connections
    │                                    (a new connection over the cap, before any read)
    ├── EngineUnavailable            502 BadGatewayError / engine_unavailable  (connect, reset)
    ├── EngineTimeout                504 GatewayTimeoutError / engine_timeout
    ├── EngineError                  502 BadGatewayError / engine_error  (engine said 5xx or
    │   │                                3xx, or failed the stream with an error event)
    │   ├── EngineProtocolError      502 ... engine_protocol_error  (a 2xx that is not the
    │   │   │                            protocol: see below)
    │   │   └── EngineReplyTooLarge  502 ... engine_reply_too_large  (reply or SSE line over
    │   │                                max_engine_reply_bytes / max_sse_line_bytes)
    │   └── EngineMisconfigured      502 ... engine_misconfigured  (a 4xx the router's
    │                                    request caused, not the client's: see below)
    └── EngineRejected               engine's own 4xx status, passed through to the client
                                         (code context_length_exceeded for its
                                         context-length refusal, else engine_rejected)

`retryable` says whether the orchestrator may try another engine of the same role (only
before the first byte went to the client).

Which engine answers are engine faults (every `EngineError` but `EngineRejected`: 502 or
504 to the client naming the engine URL, retryable before the first byte, counted against
the engine's breaker) and which are the client's (`EngineRejected`, never counted):

- the engine protocol (`EngineProtocolError`), checked in `engines.py`: a non-streaming
  reply is one UTF-8 JSON object, with a `choices` list on /v1/completions and
  /v1/chat/completions; a stream is `text/event-stream`, every `data:` line a JSON object
  or `[DONE]`, every line UTF-8, and `[DONE]` comes before the stream ends. Before the
  first byte reached the client that is a 502; mid-stream the relay ends the client's
  stream with one error event and `[DONE]`, and `EngineClient.set_stream_listener`'s
  listener hears of the failure (for the engine's breaker the app must wire it, and the
  orchestrator must not count a stream as a success when it opens: the success resets
  the breaker's count);
- sizes (`EngineReplyTooLarge`): a non-streaming reply over `max_engine_reply_bytes` is
  refused by Content-Length before reading, or as soon as the bytes read pass it; an SSE
  line longer than `max_sse_line_bytes` ends the stream. Error bodies are read to 64 KiB;
- engine 4xx (`EngineMisconfigured` when the router's request caused it): 401 and 403
  (the engine refused the router's key), 407, 421, 426, 431 (proxy auth, misdirected,
  upgrade, the router's headers), 404 and 405 on /v1/completions and /v1/chat/completions
  (a route every engine must serve), and a 400 or 422 whose message or `param` names a
  field the router added (`kv_transfer_params` or one of its keys, any field of a
  /v1/kv/* body) that the client's part of the request does not mention. Every other 4xx
  is the client's (`EngineRejected`), e.g. a 400 about `max_tokens` or the context
  length, and a 404 from an optional /v1/kv/* route (the notify and push flows fall back
  to pull on it).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

__all__ = [
    "AdapterLoadFailed",
    "AdapterUnavailable",
    "ContextLengthExceeded",
    "EngineError",
    "EngineMisconfigured",
    "EngineProtocolError",
    "EngineRejected",
    "EngineReplyTooLarge",
    "EngineTimeout",
    "EngineUnavailable",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoEndpointAvailable",
    "Overloaded",
    "PayloadTooLarge",
    "QuotaExceeded",
    "RequestTimeout",
    "RouteNotFound",
    "RouterError",
    "TooManyConnections",
    "Unauthorized",
    "error_body",
    "error_json",
]


class RouterError(Exception):
    """Base class: an error with the HTTP status and OpenAI error type/code it maps to."""

    status: int = 500
    type: str = "InternalServerError"
    code: str | None = "internal_error"
    retryable: bool = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(RouterError):
    """The client's request is malformed or out of range (400)."""

    status = 400
    type = "BadRequestError"
    code = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """prompt tokens + max_tokens exceed the model's context length (400)."""

    code = "context_length_exceeded"


class ModelNotFound(RouterError):
    """The requested model is not one of the served model names (404)."""

    status = 404
    type = "NotFoundError"
    code = "model_not_found"


class RouteNotFound(RouterError):
    """No route of the router has the request's path (404)."""

    status = 404
    type = "NotFoundError"
    code = None


class MethodNotAllowed(RouterError):
    """The path's routes take other methods (405)."""

    status = 405
    type = "BadRequestError"
    code = None


class PayloadTooLarge(RouterError):
    """The request body exceeds `max_body_bytes` (413)."""

    status = 413
    type = "BadRequestError"
    code = "payload_too_large"


class RequestTimeout(RouterError):
    """The client did not send its request body within the body deadlines (408)."""

    status = 408
    type = "BadRequestError"
    code = "request_timeout"


class Unauthorized(RouterError):
    """The request lacks the right Bearer key (401)."""

    status = 401
    type = "AuthenticationError"
    code = "invalid_api_key"


class Overloaded(RouterError):
    """Admission control refused the request: too many in flight and the queue is full, or
    it waited past the queue timeout (429). `retry_after_s` goes in the Retry-After header."""

    status = 429
    type = "RateLimitError"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: int = 1,
                 reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason  # queue_full | queue_timeout | quota (the rejection metric's label)


class QuotaExceeded(Overloaded):
    """The request's client key used its `tokens_per_minute` in the last 60 s (429;
    router/quotas.py). `retry_after_s`: seconds until the window is under the quota."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s, reason="quota")


class NoEndpointAvailable(RouterError):
    """No healthy engine of the needed role is left to try (503)."""

    status = 503
    type = "ServiceUnavailableError"
    code = "no_endpoint_available"


class AdapterUnavailable(NoEndpointAvailable):
    """A LoRA adapter some engine knows is held by no healthy engine of a leg's role, and
    the router may not load it there (no `load_on_demand`, or no source path) (503)."""

    code = "adapter_unavailable"


class AdapterLoadFailed(NoEndpointAvailable):
    """Loading a LoRA adapter onto the engine chosen for a leg failed (503; the message
    names the adapter, the engine and the engine's reason)."""

    code = "adapter_load_failed"


class TooManyConnections(RouterError):
    """A new client connection found `max_pending_connections` connections that have not
    completed a request; it is answered and closed before anything is read (503)."""

    status = 503
    type = "ServiceUnavailableError"
    code = "too_many_connections"


class EngineUnavailable(RouterError):
    """The engine could not be reached or dropped the connection before replying (502)."""

    status = 502
    type = "BadGatewayError"
    code = "engine_unavailable"
    retryable = True

    def __init__(
        self, message: str, *, connect_failed: bool = False, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        # True when no connection could be made at all: the engine is down, not just busy.
        self.connect_failed = connect_failed


class EngineTimeout(RouterError):
    """An engine leg ran past its deadline (504). Not retried: it would double the wait."""

    status = 504
    type = "GatewayTimeoutError"
    code = "engine_timeout"


class EngineError(RouterError):
    """The engine answered 5xx or broke the protocol (502). Retryable before the first byte."""

    status = 502
    type = "BadGatewayError"
    code = "engine_error"
    retryable = True


class EngineProtocolError(EngineError):
    """The engine answered 2xx with something that is not the protocol: not a JSON object,
    no `choices`, a stream that is not SSE, a bad SSE line, no `[DONE]` (502)."""

    code = "engine_protocol_error"


class EngineReplyTooLarge(EngineProtocolError):
    """An engine reply passed `max_engine_reply_bytes`, or one SSE line passed
    `max_sse_line_bytes`; the rest was not read (502)."""

    code = "engine_reply_too_large"


class EngineMisconfigured(EngineError):
    """The engine refused, with a 4xx, something the router put in the request, not the
    client: its key, its headers, a route it must serve, `kv_transfer_params` (502)."""

    code = "engine_misconfigured"
    # The engine's HTTP status (a 404 on a completion route: it does not serve the model
    # or LoRA adapter asked for, e.g. an adapter unloaded since the last probe).
    engine_status: int | None = None


# vLLM's (and the shim's) wording of a prompt plus max_tokens over the context length.
_CONTEXT_LENGTH = re.compile(r"maximum context length|longer than the maximum model length")


class EngineRejected(RouterError):
    """The engine refused the request with a 4xx; its status, message and `param` go to the
    client. The engine's context-length refusal keeps OpenAI's `context_length_exceeded`
    code, which clients branch on (vLLM's own `code` is the status number)."""

    type = "BadRequestError"
    code = "engine_rejected"

    def __init__(self, message: str, *, status: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.status = status
        if status == 400 and _CONTEXT_LENGTH.search(message):
            self.code = ContextLengthExceeded.code


def error_body(exc: RouterError) -> dict[str, Any]:
    """The OpenAI-style error object for `exc`: `{"error": {message, type, param, code}}`."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "param": exc.param,
            "code": exc.code,
        }
    }


def error_json(exc: RouterError) -> bytes:
    """`error_body(exc)` encoded as JSON bytes (used for responses and SSE error events)."""
    return msgspec.json.encode(error_body(exc))
