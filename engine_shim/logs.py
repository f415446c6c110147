"""The shim's log setup: `--log-format text|json`, and the id of the request being served
on every line logged on its behalf.

The router sends each leg with `X-Request-Id: <its internal id>`; `RequestIdMiddleware`
makes that id current (a `ContextVar`, copied into tasks the request spawns) for the
request's lifetime. Work the engine loop does for many requests at once is logged without
an id: it belongs to none of them.
"""

from __future__ import annotations

import contextvars
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from pdgate.proxy.log_format import LOG_FORMATS, configure_logging

__all__ = ["LOG_FORMATS", "RequestIdMiddleware", "current_request_id", "setup_logging"]

_MAX_ID_CHARS = 128  # a hostile header must not blow up every log line
_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pdgate_shim_request", default=None
)


def current_request_id() -> str | None:
    """The id of the request being served (None outside one, or when it sent none)."""
    return _request_id.get()


def _fields() -> dict[str, Any]:
    request_id = _request_id.get()
    return {} if request_id is None else {"request_id": request_id}


def setup_logging(level: str, fmt: str) -> None:
    """Configure the process' logging (call once from `main`, before uvicorn runs)."""
    configure_logging(level, fmt, _fields)


class RequestIdMiddleware:
    """Pure ASGI: the request's `X-Request-Id` (printable ASCII, at most 128 characters;
    otherwise none) is the id on its log lines."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = None
        if scope["type"] == "http":
            for name, raw in scope["headers"]:
                if name == b"x-request-id":
                    text = raw.decode("latin-1")
                    if len(text) <= _MAX_ID_CHARS and text.isascii() and text.isprintable():
                        value = text
                    break
        token = _request_id.set(value)
        try:
            await self.app(scope, receive, send)
        finally:
            _request_id.reset(token)
