"""Bearer-key authentication of every shim route (a pure ASGI middleware).

Installed by `server.create_app` only when the engine has an API key (`--api-key` or
`PDGATE_ENGINE_API_KEY[_FILE]`, see `credentials.py`). Then every request needs
`Authorization: Bearer <key>`, except `GET /health` (liveness probes carry no credentials and
learn nothing) and, unless `protect_metrics`, `GET /metrics` (Prometheus scrapes; the
exposition holds counts, no request ids). The internal routes matter most: without a key
anyone reaching the port could hold every KV block (`/v1/kv/reserve`), free another
request's blocks (`/v1/kv/abort`), list request ids (`/debug/kv_transfers`) or send
completions past the router.

Keys are compared in constant time (`common/bearer.py`, the router's check too) and never
logged. A refusal is a 401 with an OpenAI-style error body and `WWW-Authenticate: Bearer`,
sent before the body is read. Paths are matched exactly (no prefix, no trailing-slash
variants), so anything not listed as open needs the key.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pdgate.common.bearer import bearer_matches
from pdgate.engine_shim.openai_types import error_body

__all__ = ["EngineAuth", "bearer_matches"]

_HEALTH = ("GET", "/health")
_METRICS = ("GET", "/metrics")
_MESSAGE = "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."


class EngineAuth:
    """Refuses any request without the Bearer `api_key`, but the open routes.
    `on_refuse()` is called once per refusal (the server counts them)."""

    def __init__(self, app: ASGIApp, *, api_key: str, protect_metrics: bool = False,
                 on_refuse: Callable[[], None] | None = None) -> None:
        if not api_key:
            raise ValueError("EngineAuth needs a non-empty api_key")
        self.app = app
        self._key = api_key.encode()
        self._open = {_HEALTH} if protect_metrics else {_HEALTH, _METRICS}
        self._on_refuse = on_refuse or (lambda: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        self._on_refuse()
        if scope["type"] == "websocket":  # no websocket routes; refuse like the rest
            await send({"type": "websocket.close", "code": 1008})
            return
        await _refuse(send)

    def _allowed(self, scope: Scope) -> bool:
        if scope["type"] == "http" and (scope["method"], scope["path"]) in self._open:
            return True
        return bearer_matches(_header(scope, b"authorization"), self._key)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


async def _refuse(send: Send) -> None:
    body = error_body(_MESSAGE, "AuthenticationError", 401)
    await send({
        "type": "http.response.start",
        "status": 401,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ],
    })
    await send({"type": "http.response.body", "body": body})
