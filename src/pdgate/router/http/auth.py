"""Key checks for the OpenAI routes (`/v1/*`), the admin API (`/admin/*`) and the status
page (`/dashboard*`).

A pure ASGI middleware (no per-request objects beyond a header scan). Client keys (any of
`RouterConfig.client_api_keys`) guard `/v1/`; `admin_api_key` guards `/admin` and
`/dashboard` (the page shows engine addresses and state). The dashboard also takes HTTP
Basic credentials with the admin key as password, so a browser can open it (it prompts once
and resends them for the page's polling). `/health`, `/ready` and `/metrics` stay open on
purpose: load balancers and Prometheus scrape them without credentials, and they reveal no
request data. Every accepted key is compared in constant time (`common/bearer.py`, the
check the shim uses too: all keys checked, no early exit) and never logged; a refused
request gets a 401 with an OpenAI-style error body and a `WWW-Authenticate` challenge.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from pdgate.common.bearer import any_key_matches, bearer_matches
from pdgate.router.errors import Unauthorized, error_json

__all__ = ["AuthMiddleware", "any_key_matches", "bearer_matches"]


class _Rule:
    __slots__ = ("prefix", "keys", "basic")

    def __init__(self, prefix: str, keys: Sequence[str], basic: bool) -> None:
        self.prefix = prefix
        self.keys = tuple(k.encode() for k in keys)
        self.basic = basic


class AuthMiddleware:
    """Refuses `/v1/` requests without one of `api_keys`, and `/admin` and `/dashboard`
    requests without `admin_api_key` (each check only when its keys are set). Other paths
    pass through."""

    def __init__(
        self, app: ASGIApp, *, api_keys: Sequence[str] = (), admin_api_key: str | None = None
    ) -> None:
        self.app = app
        self._rules: list[_Rule] = []
        if api_keys:
            self._rules.append(_Rule("/v1/", api_keys, basic=False))
        if admin_api_key:
            self._rules.append(_Rule("/admin", [admin_api_key], basic=False))
            self._rules.append(_Rule("/dashboard", [admin_api_key], basic=True))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._rules:
            path: str = scope["path"]
            for rule in self._rules:
                if path.startswith(rule.prefix):
                    auth = _header(scope, b"authorization")
                    if not any_key_matches(auth, rule.keys, basic=rule.basic):
                        await _refuse(send, basic=rule.basic)
                        return
                    break
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


async def _refuse(send: Send, *, basic: bool = False) -> None:
    body = error_json(Unauthorized(
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."
    ))
    await send({
        "type": "http.response.start",
        "status": 401,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Basic realm="pdgate"' if basic else b"Bearer"),
        ],
    })
    await send({"type": "http.response.body", "body": body})
