"""Request-body size limit (a pure ASGI middleware), so hostile bodies cost no memory.

Handlers buffer and decode a whole body (`await request.body()`): a 200 MB body cost ~470 MiB
of RSS before it was refused as a bad request. This refuses it with a 413 and an OpenAI-style
error body instead:

- at once when `Content-Length` announces more than `max_bytes` (nothing is read);
- while reading a body without a length (chunked), as soon as the bytes received cross
  `max_bytes`, so at most one chunk beyond the limit is ever held.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdgate.engine_shim.openai_types import error_body

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodyLimit"]

DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 128k-token prompt as token ids is ~1 MB of JSON


class _TooLarge(Exception):
    """Raised from `receive` inside the app once the body crossed the limit."""


class BodyLimit:
    """413 for HTTP requests whose body exceeds `max_bytes`. `on_refuse()` is called once
    per refusal (the server counts them)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 on_refuse: Callable[[], None] | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self._on_refuse = on_refuse or (lambda: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = _content_length(scope)
        if announced is not None and announced > self.max_bytes:
            await self._refuse(send, announced)
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if started:  # handlers read the body before answering; never expected here
                raise
            await self._refuse(send, None)

    async def _refuse(self, send: Send, announced: int | None) -> None:
        self._on_refuse()
        size = f"{announced} bytes" if announced is not None else "more than that"
        body = error_body(f"request body too large: the limit is {self.max_bytes} bytes, "
                          f"got {size}", "RequestTooLargeError", 413)
        await send({
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),  # the rest of the body is not worth reading
            ],
        })
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses these; counting still bounds the body
    return None
