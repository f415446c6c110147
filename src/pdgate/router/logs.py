"""The router's log setup: `--log-format text|json`, with the current request's ids on
every line logged on its behalf (from router/request_context.py)."""

from __future__ import annotations

import logging
from typing import Any

from pdgate.common.log_format import LOG_FORMATS, configure_logging
from pdgate.router import request_context

__all__ = ["LOG_FORMATS", "request_fields", "setup_logging"]


def request_fields() -> dict[str, Any]:
    """The ids of the request being served, for a log line ({} outside a request)."""
    record = request_context.current()
    if record is None or record.request_id is None:
        return {}
    fields: dict[str, Any] = {"request_id": record.request_id}
    if record.client_request_id:
        fields["client_request_id"] = record.client_request_id
    return fields


def setup_logging(level: str, fmt: str) -> None:
    """Configure the process' logging (call once from `main`, before uvicorn runs). Python
    warnings (deprecations from libraries) come out as log lines of logger `py.warnings`,
    in the same format, instead of bare text on stderr."""
    configure_logging(level, fmt, request_fields)
    logging.captureWarnings(True)
