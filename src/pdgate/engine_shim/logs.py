"""The shim's log setup: `--log-format text|json`, and the id of the request being served
on every line logged on its behalf.

The router sends each leg with `X-Request-Id: <its internal id>`; `RequestIdMiddleware`
makes that id current (a `ContextVar`, copied into tasks the request spawns) for the
request's lifetime. Work the engine loop does for many requests at once is logged without
an id: it belongs to none of them.

Python warnings go through logging (logger `py.warnings`), and `fold_library_loggers()`
gives the loggers of libraries that install a stream handler of their own (NIXL's Python
API, transformers) back to the root handler, so those lines take `--log-format` too.
Output that native code (UCX, NIXL's C++ core) writes straight to the process' stdout or
stderr bypasses Python and stays as it is.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from pdgate.common.log_format import LOG_FORMATS, configure_logging

__all__ = [
    "LOG_FORMATS", "RequestIdMiddleware", "current_request_id", "fold_library_loggers",
    "setup_logging",
]

_MAX_ID_CHARS = 128  # a hostile header must not blow up every log line
# Libraries whose import gives their top logger a stdout/stderr handler with their own format
# and cuts it off from the root: NIXL's `nixl` (when nixl is imported, i.e. when the
# connector starts) and `transformers` (when the tokenizer loads).
_LIBRARY_LOGGERS = ("nixl", "transformers")
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
    logging.captureWarnings(True)


def fold_library_loggers() -> None:
    """Send the `_LIBRARY_LOGGERS` through the root's handler (their own handlers removed;
    their levels kept). Call after importing such a library; a no-op while the root has no
    handler (logging not set up: the library's own output is then all there is)."""
    if not logging.getLogger().handlers:
        return
    for name in _LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers or not logger.propagate:
            logger.handlers.clear()
            logger.propagate = True


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
