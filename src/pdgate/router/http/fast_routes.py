"""The completion routes straight to their handlers, in front of the framework app.

Behind instant engines, FastAPI's per-request stack (its telemetry check, body-limit,
exception and exit-stack middlewares, the router's path matching, `request_response`'s
wrappers) cost about as much CPU as the router's own work. `FastRoutes` sends
`POST /v1/completions` and `POST /v1/chat/completions` to the same handlers through the
router's own pure-ASGI middlewares (access log, tracing, keys), built by the same function
as the framework app's; every other request (other methods and paths, trailing slashes,
lifespan) goes to the framework app unchanged, with its 404/405 answers and error handlers.

The handlers catch every error themselves (OpenAI-style bodies, 500 for a bug), so the
framework's exception middlewares had nothing to do on these routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["FastRoutes", "endpoint_app"]

Handler = Callable[[Request], Awaitable[Response]]


def endpoint_app(handler: Handler) -> ASGIApp:
    """A request handler as a plain ASGI app (what Starlette's `Route` does, minus its
    exception wrapping and thread-pool dispatch)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)

    return app


class FastRoutes:
    """ASGI: `POST <path>` for each path in `routes` goes to its app; all else to `app`."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, ASGIApp]) -> None:
        self.app = app
        self._routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self._routes.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await self.app(scope, receive, send)
