"""One access line per request, logged by the router when the response is over.

A pure ASGI middleware (streaming answers pass through untouched): it opens the request's
`RequestRecord` (router/request_context.py) so that everything below can note what it
learns (the completion handler notes the ids and the engines that served, the ones its
response headers name), watches the response start for the status, and logs once the app
returned, i.e. after the last byte of a stream. Fields: method, path,
status, duration_s, request_id, client_request_id, model, mode, fallback, ttft_s,
admission_wait_s, prompt_tokens, completion_tokens, prefill_engine, decode_engine (null
when unknown).

Probes and scrapes (`/health`, `/ready`, `/metrics`, `/dashboard/state`) are logged at
DEBUG: every few seconds from each kubelet and Prometheus, they would bury the requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdgate.router import request_context
from pdgate.router.request_context import RequestRecord

__all__ = ["AccessLogMiddleware"]

log = logging.getLogger("pdgate.router.access")
_QUIET = frozenset({"/health", "/ready", "/metrics", "/dashboard/state"})


class AccessLogMiddleware:
    """Wraps the router app. `pd_mode` is the configured flow. A request's mode is what
    `RouterMetrics.observe_ttft` noted (the TTFT label); failing that, it is read from the
    engines that served it: both legs → the flow's label (`disagg` for pull, else the
    mode), a decode engine alone → `direct`."""

    def __init__(self, app: ASGIApp, pd_mode: str) -> None:
        self.app = app
        self.pd_mode = pd_mode

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"])
        token = request_context.open_record(record)
        status = 500  # the app raised before it answered

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            level = logging.DEBUG if record.path in _QUIET else logging.INFO
            if log.isEnabledFor(level):
                fields = _fields(record, status, self.pd_mode)
                log.log(level, "%s %s %d %.3fs", record.method, record.path, status,
                        fields["duration_s"], extra={"fields": fields})
            request_context.close_record(token)


def _mode(record: RequestRecord, pd_mode: str) -> str | None:
    if record.mode is not None:
        return record.mode
    if "prefill" in record.engines:
        return "disagg" if pd_mode == "pull" else pd_mode
    return "direct" if "decode" in record.engines else None


def _fields(record: RequestRecord, status: int, pd_mode: str) -> dict[str, Any]:
    return {
        "access": True,
        "method": record.method,
        "path": record.path,
        "status": status,
        "duration_s": round(time.perf_counter() - record.arrival, 6),
        "request_id": record.request_id,
        "client_request_id": record.client_request_id,
        "model": record.model,
        "mode": _mode(record, pd_mode),
        "fallback": record.fallback,
        "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 6),
        "admission_wait_s": None if record.admission_wait_s is None
        else round(record.admission_wait_s, 6),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "prefill_engine": record.engines.get("prefill"),
        "decode_engine": record.engines.get("decode"),
    }
