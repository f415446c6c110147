"""Bearer-key checks for the OpenAI routes (`/v1/*`) and the admin API (`/admin/*`).

A pure ASGI middleware (no per-request objects beyond a header scan) with two independent
keys: `api_key` guards `/v1/`, `admin_api_key` guards `/admin/`. `/health`, `/ready` and
`/metrics` stay open on purpose: load balancers and Prometheus scrape them without
credentials, and they reveal no request data. Keys are compared in constant time
(`hmac.compare_digest`) and never logged; a refused request gets a 401 with an OpenAI-style
error body and `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import Unauthorized, error_json

__all__ = ["AuthMiddleware", "bearer_matches"]


def bearer_matches(authorization: bytes | None, key: bytes) -> bool:
    """True when an `Authorization` header value is `Bearer <key>` (scheme case-insensitive,
    constant-time comparison of the key)."""
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(), key)


class AuthMiddleware:
    """Refuses `/v1/` requests without `api_key` and `/admin/` requests without
    `admin_api_key` (each check only when its key is set). Other paths pass through."""

    def __init__(
        self, app: ASGIApp, *, api_key: str | None = None, admin_api_key: str | None = None
    ) -> None:
        self.app = app
        self._rules: list[tuple[str, bytes]] = []
        if api_key:
            self._rules.append(("/v1/", api_key.encode()))
        if admin_api_key:
            self._rules.append(("/admin", admin_api_key.encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._rules:
            path: str = scope["path"]
            for prefix, key in self._rules:
                if path.startswith(prefix):
                    if not bearer_matches(_header(scope, b"authorization"), key):
                        await _refuse(send)
                        return
                    break
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


async def _refuse(send: Send) -> None:
    body = error_json(Unauthorized(
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."
    ))
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
