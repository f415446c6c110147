"""The admin API: inspect and change the engine pool at run time, read the effective config.

Installed only when `admin_api_key` is set; `router.auth.AuthMiddleware` checks that key on
every `/admin` request (a separate key from the OpenAI one, so client keys cannot reshape the
pool). Routes:

    GET    /admin/engines                    every engine: role, health, in-flight, breaker
    POST   /admin/engines  {"url", "role"}   start routing to an engine (201; 200 if known)
    DELETE /admin/engines?url=U&drain=true   drain (default: finish in-flight, then remove)
                                             or, with drain=false, remove at once
    GET    /admin/config                     the effective RouterConfig, secrets redacted

Engine URLs are validated (`check_engine_url`): http(s) only, a host, no credentials, no
path/query/fragment — the router never follows redirects, so the URL is exactly where
requests go.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pdgate.router.config import RouterConfig, engine_url_problem
from pdgate.router.errors import InvalidRequest, RouterError
from pdgate.router.http.api import StateHolder, error_response
from pdgate.router.http.client_deadlines import read_body_within
from pdgate.router.http.routes import RouteTable
from pdgate.router.pool import Endpoint

__all__ = ["check_engine_url", "endpoint_info", "install_admin_routes", "redacted_config"]

_SECRETS = ("api_key", "api_keys", "admin_api_key", "engine_api_key", "notify_secret")
_REDACTED = "<redacted>"
_encode = msgspec.json.Encoder().encode
_MAX_BODY = 64 * 1024


class AddEngine(msgspec.Struct, forbid_unknown_fields=True):
    """Body of `POST /admin/engines`."""

    url: str
    role: str


class NotFound(RouterError):
    """The engine named in an admin request is not in the pool (404)."""

    status = 404
    type = "NotFoundError"
    code = "engine_not_found"


def check_engine_url(url: str) -> str:
    """`url` normalized (no trailing slash) if it is a usable engine base URL; else raises
    `InvalidRequest` saying why (rules: `router.config.engine_url_problem`)."""
    problem = engine_url_problem(url)
    if problem is not None:
        raise InvalidRequest(f"{problem}: {url!r}", param="url")
    parts = urlsplit(url.strip())
    return f"{parts.scheme}://{parts.netloc}"


def endpoint_info(ep: Endpoint) -> dict[str, Any]:
    """What `GET /admin/engines` shows of one engine."""
    return {
        "url": ep.url,
        "rank": ep.rank,  # DP rank behind the URL (None: not data-parallel)
        "role": ep.role,
        "healthy": ep.healthy,
        "draining": ep.draining,
        "in_flight": ep.in_flight,
        "breaker": ep.health.state.value,
        "consecutive_errors": ep.health.consecutive_errors,
    }


def redacted_config(config: RouterConfig) -> dict[str, Any]:
    """The config as plain data with every secret replaced by a marker (None stays None)."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    for key in _SECRETS:
        if data.get(key) is not None:
            data[key] = _REDACTED
    return data


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encode(obj), status, media_type="application/json")


def install_admin_routes(table: RouteTable, holder: StateHolder) -> None:
    """Declare the `/admin` routes in `table` (the caller guards them with a key)."""

    async def list_engines(request: Request) -> Response:
        return _json({"engines": [endpoint_info(ep) for ep in holder.state.pool.all()]})

    async def add_engine(request: Request) -> Response:
        pool = holder.state.pool
        try:
            cfg = holder.state.config
            raw = await read_body_within(request, _MAX_BODY, cfg.body_timeout_s,
                                         cfg.body_chunk_timeout_s)
            body = msgspec.json.decode(raw, type=AddEngine)
        except msgspec.DecodeError as exc:
            return error_response(InvalidRequest(f"invalid body: {exc}"))
        except RouterError as exc:
            return error_response(exc)
        try:
            url = check_engine_url(body.url)
            if body.role not in ("prefill", "decode"):
                raise InvalidRequest("role must be 'prefill' or 'decode'", param="role")
        except RouterError as exc:
            return error_response(exc)
        known = any(ep.url == url and ep.role == body.role and not ep.draining
                    for ep in pool.all())
        ep = pool.add(url, "prefill" if body.role == "prefill" else "decode")
        return _json(endpoint_info(ep), 200 if known else 201)

    async def delete_engine(request: Request) -> Response:
        pool = holder.state.pool
        url = request.query_params.get("url")
        if not url:
            return error_response(InvalidRequest("query parameter 'url' is required",
                                                 param="url"))
        url = url.rstrip("/")
        drain = request.query_params.get("drain", "true").lower() not in ("false", "0", "no")
        found = pool.drain(url) if drain else pool.remove(url)
        if not found:
            return error_response(NotFound(f"no engine {url!r} in the pool", param="url"))
        still = [endpoint_info(ep) for ep in pool.all() if ep.url == url]
        return _json({"url": url, "drain": drain, "removed": not still, "engines": still})

    async def config(request: Request) -> Response:
        return _json(redacted_config(holder.state.config))

    table.add("GET", "/admin/engines", list_engines)
    table.add("POST", "/admin/engines", add_engine)
    table.add("DELETE", "/admin/engines", delete_engine)
    table.add("GET", "/admin/config", config)
