"""The router's error tree and its one mapping to an OpenAI-style error body.

Every failure the router reports to a client is a `RouterError`. Adapters translate foreign
exceptions at their edge (aiohttp in `engines.py`, msgspec in `api.py`), so the rest of the
code only ever sees this tree::

    RouterError                      (500 InternalServerError — only for bugs we caught)
    ├── InvalidRequest               400 BadRequestError / invalid_request_error
    │   └── ContextLengthExceeded    400 ... code context_length_exceeded
    ├── ModelNotFound                404 NotFoundError / model_not_found
    ├── PayloadTooLarge              413 BadRequestError / payload_too_large
    ├── RequestTimeout               408 BadRequestError / request_timeout  (slow body)
    ├── Unauthorized                 401 AuthenticationError / invalid_api_key
    ├── Overloaded                   429 RateLimitError / overloaded  (+ Retry-After)
    ├── NoEndpointAvailable          503 ServiceUnavailableError / no_endpoint_available
    ├── EngineUnavailable            502 BadGatewayError / engine_unavailable  (connect, reset)
    ├── EngineTimeout                504 GatewayTimeoutError / engine_timeout
    ├── EngineError                  502 BadGatewayError / engine_error  (engine said 5xx or
    │                                    sent something that is not the protocol)
    └── EngineRejected               engine's own 4xx status, passed through to the client

`retryable` says whether the orchestrator may try another engine of the same role (only
before the first byte went to the client).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "ContextLengthExceeded",
    "EngineError",
    "EngineRejected",
    "EngineTimeout",
    "EngineUnavailable",
    "InvalidRequest",
    "ModelNotFound",
    "NoEndpointAvailable",
    "Overloaded",
    "PayloadTooLarge",
    "RequestTimeout",
    "RouterError",
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
        self.reason = reason  # queue_full | queue_timeout (the rejection metric's label)


class NoEndpointAvailable(RouterError):
    """No healthy engine of the needed role is left to try (503)."""

    status = 503
    type = "ServiceUnavailableError"
    code = "no_endpoint_available"


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


class EngineRejected(RouterError):
    """The engine refused the request with a 4xx; its status and message go to the client."""

    type = "BadRequestError"
    code = "engine_rejected"

    def __init__(self, message: str, *, status: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.status = status


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
