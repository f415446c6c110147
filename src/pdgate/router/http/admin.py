"""The admin API: inspect and change the engine pool at run time, read the effective config.

Installed only when `admin_api_key` is set; `router.auth.AuthMiddleware` checks that key on
every `/admin` request (a separate key from the OpenAI one, so client keys cannot reshape the
pool). Routes:

    GET    /admin/engines                    every engine of every model: model, role,
                                             health, in-flight, breaker
    POST   /admin/engines  {"url", "role",   start routing a model's requests to an engine
                            "model"?}        (201; 200 if known); `model`: a served name
                                             (default: the first model)
    DELETE /admin/engines?url=U&drain=true   drain (default: finish in-flight, then remove)
           [&model=NAME]                     or, with drain=false, remove at once; from
                                             every model's pool, or only NAME's
    GET    /admin/config                     the effective RouterConfig, secrets redacted

An engine serving several models is in each of their pools (one entry per model in the
list); removing it without `model` takes it out of all of them (it is one process, e.g.
going away for maintenance). An unknown `model` is 404 `model_not_found`.

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
    model: str | None = None


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


def endpoint_info(ep: Endpoint, model: str) -> dict[str, Any]:
    """What `GET /admin/engines` shows of one engine of `model`'s pool."""
    return {
        "model": model,
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
    for entry in data.get("client_keys", []):  # their names and settings are not secret
        entry["key"] = _REDACTED
    return data


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encode(obj), status, media_type="application/json")


def install_admin_routes(table: RouteTable, holder: StateHolder) -> None:
    """Declare the `/admin` routes in `table` (the caller guards them with a key)."""

    async def list_engines(request: Request) -> Response:
        return _json({"engines": [endpoint_info(ep, m.name) for m in holder.state.models.models
                                  for ep in m.pool.all()]})

    async def add_engine(request: Request) -> Response:
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
            model = holder.state.models.resolve(body.model)
        except RouterError as exc:
            return error_response(exc)
        pool = model.pool
        known = any(ep.url == url and ep.role == body.role and not ep.draining
                    for ep in pool.all())
        ep = pool.add(url, "prefill" if body.role == "prefill" else "decode")
        return _json(endpoint_info(ep, model.name), 200 if known else 201)

    async def delete_engine(request: Request) -> Response:
        url = request.query_params.get("url")
        name = request.query_params.get("model")
        if not url:
            return error_response(InvalidRequest("query parameter 'url' is required",
                                                 param="url"))
        try:
            models = [holder.state.models.resolve(name)] if name else \
                list(holder.state.models.models)
        except RouterError as exc:
            return error_response(exc)
        url = url.rstrip("/")
        drain = request.query_params.get("drain", "true").lower() not in ("false", "0", "no")
        found = [m for m in models if (m.pool.drain(url) if drain else m.pool.remove(url))]
        if not found:
            where = f"model `{name}`'s pool" if name else "any pool"
            return error_response(NotFound(f"no engine {url!r} in {where}", param="url"))
        still = [endpoint_info(ep, m.name) for m in found for ep in m.pool.all()
                 if ep.url == url]
        return _json({"url": url, "drain": drain, "removed": not still,
                      "models": [m.name for m in found], "engines": still})

    async def config(request: Request) -> Response:
        return _json(redacted_config(holder.state.config))

    table.add("GET", "/admin/engines", list_engines)
    table.add("POST", "/admin/engines", add_engine)
    table.add("DELETE", "/admin/engines", delete_engine)
    table.add("GET", "/admin/config", config)
