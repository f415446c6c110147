"""The router's one route table: every HTTP route is declared once, as (method, path,
endpoint), and every request, the 404 and 405 answers included, passes the same
middlewares (keys, CORS, tracing, access log), built for each entry by one function.

Not a framework router: behind instant engines, FastAPI's per-request stack (its telemetry
check, body-limit, exception and exit-stack middlewares, path matching, `request_response`'s
wrappers) cost about as much CPU as the router's own work. `RouterApp` finds a route with
one dict lookup on the path (then one on the method) and calls its endpoint, already
wrapped in the middlewares; it answers the ASGI lifespan itself.

A path is exact, or a prefix ending in one `{name:path}` parameter that takes the rest of
the path (`/v1/models/{model:path}`: served names may hold slashes). A GET route answers
HEAD too. A path that only lacks or has an extra trailing slash is redirected (307), as
the framework did. Endpoints answer their own errors (OpenAI-style bodies); one that
raises anyway is logged and answered 500, and a client that left while its request was
read (`ClientDisconnect`) is a 499 nobody reads, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pdgate.router.errors import MethodNotAllowed, RouteNotFound, RouterError, error_json

__all__ = ["Endpoint", "Middleware", "Route", "RouteTable", "RouterApp"]

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]
Middleware = tuple[Any, dict[str, Any]]
"""A pure-ASGI middleware class and its options: `cls(app, **options)`."""
Lifespan = Callable[[], contextlib.AbstractAsyncContextManager[None]]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # as declared, e.g. "/v1/models/{model:path}"
    endpoint: Endpoint

    @property
    def param(self) -> tuple[str, str] | None:
        """(prefix, name) of a `{name:path}` route, else None."""
        if not self.path.endswith(":path}"):
            return None
        prefix, _, name = self.path[:-len(":path}")].rpartition("{")
        return prefix, name


class RouteTable:
    """The routes, in declaration order. `add` refuses a second declaration of a method
    and path: a route that another would shadow could never run."""

    def __init__(self) -> None:
        self._routes: list[Route] = []

    def add(self, method: str, path: str, endpoint: Endpoint) -> None:
        route = Route(method.upper(), path, endpoint)
        if not path.startswith("/") or ("{" in path and route.param is None) or (
                route.param is not None and "{" in route.param[0]):
            raise ValueError(f"route path {path!r}: exact, or ending in one {{name:path}}")
        for known in self._routes:
            if known.path == path and known.method == route.method:
                raise ValueError(f"route {route.method} {path} declared twice")
        self._routes.append(route)

    @property
    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes)

    def app(self, middlewares: Sequence[Middleware], lifespan: Lifespan) -> RouterApp:
        """The ASGI app serving these routes. `middlewares`: innermost first."""
        return RouterApp(self.routes, middlewares, lifespan)


class RouterApp:
    """ASGI app of a `RouteTable` (see the module docstring). `routes` lists what it
    serves."""

    def __init__(self, routes: Sequence[Route], middlewares: Sequence[Middleware],
                 lifespan: Lifespan) -> None:
        self.routes = tuple(routes)
        self._middlewares = tuple(middlewares)
        self._lifespan = lifespan
        self._exact: dict[str, dict[str, ASGIApp]] = {}
        prefixed: dict[str, tuple[str, dict[str, ASGIApp]]] = {}
        for route in self.routes:
            if (param := route.param) is None:
                slot = self._exact.setdefault(route.path, {})
            else:
                slot = prefixed.setdefault(param[0], (param[1], {}))[1]
            app = self._wrap(_endpoint_app(route.endpoint))
            slot[route.method] = app  # each (method, path) is declared once
            if route.method == "GET":
                slot.setdefault("HEAD", app)  # unless a HEAD route of its own is declared
        # The longest prefix first: a longer one is the more specific route.
        self._prefixed = dict(sorted(prefixed.items(), key=lambda kv: -len(kv[0])))
        self._not_found = self._wrap(_error_app(RouteNotFound("Not Found")))
        self._not_allowed = {id(apps): self._wrap(_error_app(
            MethodNotAllowed("Method Not Allowed"), {"Allow": ", ".join(sorted(apps))}))
            for apps in self._all_method_sets()}

    def _wrap(self, app: ASGIApp) -> ASGIApp:
        for cls, options in self._middlewares:
            app = cls(app, **options)
        return app

    def _all_method_sets(self) -> list[dict[str, ASGIApp]]:
        return [*self._exact.values(), *(apps for _, apps in self._prefixed.values())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            apps = self._exact.get(path)
            if apps is None:
                apps = self._match_prefix(scope, path)
            app = None if apps is None else apps.get(scope["method"])
            if app is None:
                app = self._miss(scope, path, apps)
            await app(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._serve_lifespan(receive, send)
        else:  # websocket: the router serves none
            await send({"type": "websocket.close", "code": 1000})

    def _match_prefix(self, scope: Scope, path: str) -> dict[str, ASGIApp] | None:
        for prefix, (name, apps) in self._prefixed.items():
            if path.startswith(prefix):
                scope["path_params"] = {name: path[len(prefix):]}
                return apps
        return None

    def _miss(self, scope: Scope, path: str, apps: dict[str, ASGIApp] | None) -> ASGIApp:
        if apps is not None:
            return self._not_allowed[id(apps)]
        other = path[:-1] if path.endswith("/") else path + "/"
        if path != "/" and (other in self._exact or any(
                other.startswith(prefix) for prefix in self._prefixed)):
            query = scope.get("query_string", b"")
            return self._wrap(_redirect_app(other + ("?" + query.decode("latin-1")
                                                     if query else "")))
        return self._not_found

    async def _serve_lifespan(self, receive: Receive, send: Send) -> None:
        """The ASGI lifespan protocol around `lifespan()` (as Starlette's router does)."""
        started = False
        await receive()  # lifespan.startup
        try:
            async with self._lifespan():
                await send({"type": "lifespan.startup.complete"})
                started = True
                await receive()  # lifespan.shutdown
        except BaseException:
            failed = "lifespan.shutdown.failed" if started else "lifespan.startup.failed"
            await send({"type": failed, "message": traceback.format_exc()})
            raise
        await send({"type": "lifespan.shutdown.complete"})


def _endpoint_app(endpoint: Endpoint) -> ASGIApp:
    """An endpoint as a plain ASGI app (Starlette's `Route` minus its exception wrapping
    and thread-pool dispatch)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await endpoint(Request(scope, receive))
        except ClientDisconnect:  # the client left while its request was read
            response = Response(b"", 499)
        except Exception:  # a bug: log it, answer like an engine would, keep serving
            log.exception("%s %s failed", scope["method"], scope["path"])
            response = _error_response(RouterError("internal router error"))
        await response(scope, receive, send)

    return app


def _error_response(exc: RouterError, headers: dict[str, str] | None = None) -> Response:
    return Response(error_json(exc), exc.status, headers, "application/json")


def _error_app(exc: RouterError, headers: dict[str, str] | None = None) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await _error_response(exc, headers)(scope, receive, send)

    return app


def _redirect_app(location: str) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await Response(b"", 307, {"Location": location})(scope, receive, send)

    return app


@contextlib.asynccontextmanager
async def no_lifespan() -> AsyncIterator[None]:
    """A lifespan with nothing to start (tests of the table alone)."""
    yield
