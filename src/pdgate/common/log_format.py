"""Process log setup shared by the router and the shim: `text` or `json` lines on stderr.

`configure_logging(level, fmt, context)` installs one stderr handler on the root logger and
folds uvicorn's loggers into it (their own handlers removed, so every line of the process has
one format). `context()` returns the fields of the request being served (its ids), added to
every line logged while it runs. A JSON line is one object:
`{"ts", "level", "logger", "msg", <context>, <extra fields>, "exc"?}`; extra fields come from
`logger.info(..., extra={"fields": {...}})` (the router's access line uses that).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, TextIO, get_args

__all__ = ["LOG_FORMATS", "LogFormat", "configure_logging"]

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
Context = Callable[[], Mapping[str, Any]]
# uvicorn logs through these; its default config gives them their own handlers and format.
_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")


class _JsonFormatter(logging.Formatter):
    def __init__(self, context: Context) -> None:
        super().__init__()
        self.converter = time.gmtime  # the timestamp says "Z"
        self._context = context

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self._context(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _TextFormatter(logging.Formatter):
    def __init__(self, context: Context) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._context = context

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        pairs = {**self._context(), **getattr(record, "fields", {})}
        if not pairs:
            return text
        head, sep, tail = text.partition("\n")  # a traceback stays below the line
        return head + " " + " ".join(f"{k}={v}" for k, v in pairs.items()) + sep + tail


def configure_logging(level: str, fmt: str, context: Context,
                      stream: TextIO | None = None) -> None:
    """Log at `level` (a logging level name, any case) in `fmt` (`text` | `json`) to
    `stream` (default: stderr), with `context()`'s fields on each line. Call once, at
    process start, before uvicorn runs (give uvicorn `log_config=None` so it keeps this
    setup)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(_JsonFormatter(context) if fmt == "json" else _TextFormatter(context))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in _UVICORN:
        uv = logging.getLogger(name)
        uv.handlers.clear()
        uv.propagate = True
        uv.setLevel(logging.NOTSET)
