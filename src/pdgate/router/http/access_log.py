"""One access line per request, logged by the router when the response is over.

A pure ASGI middleware (streaming answers pass through untouched): it opens the request's
`RequestRecord` (router/request_context.py) so that everything below can note what it
learns (the completion handler notes the ids and the engines that served, the ones its
response headers name), watches the response start for the status, and logs once the app
returned, i.e. after the last byte of a stream (and tells the request's watcher it ended,
router/request_context.py). Fields: method, path,
status, duration_s, request_id, client_request_id, model, mode, fallback, decision (the
decider's reason), predicted_ttft_s (the measured-cost decider's prediction), ttft_s
(null for a non-streaming answer that came whole, its first token never seen; one the router
reads as a stream itself, `--migrate-non-streaming`, has it),
prefill_s (the P leg's round trip: what of the TTFT was P's; null without one),
admission_wait_s, prompt_tokens, completion_tokens, prefill_engine, decode_engine (null
when unknown), migrations (continuations of a stream whose decode engine failed
mid-response; null when none was tried), and for a refused request (status >= 400)
error_code: the `code` (else the `type`) of its OpenAI-style error body, read from the
first bytes the client got.

Probes and scrapes (`/health`, `/ready`, `/metrics`, `/dashboard/state`) are logged at
DEBUG: every few seconds from each kubelet and Prometheus, they would bury the requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdgate.router import request_context
from pdgate.router.request_context import RequestRecord

__all__ = ["AccessLogMiddleware"]

log = logging.getLogger("pdgate.router.access")
_QUIET = frozenset({"/health", "/ready", "/metrics", "/dashboard/state"})
_ERROR_BODY_MAX = 4096  # error bodies are small; a bigger one is not an error object


class _Error(msgspec.Struct):
    code: Any = None
    type: Any = None


class _ErrorBody(msgspec.Struct):
    error: _Error | None = None


def _error_code(body: bytes) -> str | None:
    """The `code` (else `type`) of an OpenAI-style error body; None for anything else."""
    try:
        error = msgspec.json.decode(body, type=_ErrorBody).error
    except (msgspec.DecodeError, RecursionError):
        return None
    if error is None:
        return None
    for value in (error.code, error.type):
        if isinstance(value, str) and value:
            return value
    return None


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
        error_body = bytearray()  # the start of a refusal's body (its error code)

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif status >= 400 and len(error_body) <= _ERROR_BODY_MAX:
                error_body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if record.watcher is not None:
                record.watcher.ended()
            level = logging.DEBUG if record.path in _QUIET else logging.INFO
            if log.isEnabledFor(level):
                fields = _fields(record, status, self.pd_mode)
                if status >= 400:
                    fields["error_code"] = _error_code(bytes(error_body))
                log.log(level, "%s %s %d %.3fs%s", record.method, record.path, status,
                        fields["duration_s"], f" {fields['error_code']}"
                        if fields.get("error_code") else "", extra={"fields": fields})
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
        "decision": record.decision,
        "predicted_ttft_s": None if record.predicted_ttft_s is None
        else round(record.predicted_ttft_s, 6),
        "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 6),
        "prefill_s": None if record.prefill_s is None else round(record.prefill_s, 6),
        "admission_wait_s": None if record.admission_wait_s is None
        else round(record.admission_wait_s, 6),
        "priority": record.priority,
        "client_key": record.client_key,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "prefill_engine": record.engines.get("prefill"),
        "decode_engine": record.engines.get("decode"),
        "migrations": record.migrations,
    }
