"""SSE relay helper: rewrite the `usage` object of streamed chunks, touch nothing else.

Bytes are passed on as soon as a line is complete; only a trailing partial line is held
back. Lines that do not mention `"usage"` are never parsed, so the cost on ordinary token
chunks is one substring search.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["UsageRewriter"]

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
_DATA = b"data: "


class UsageRewriter:
    """Feeds SSE bytes through, applying `fix(usage_dict)` to every chunk that carries a
    usage object. Call `feed()` per received chunk and `flush()` at the end."""

    def __init__(self, fix: Callable[[dict[str, Any]], None]) -> None:
        self._fix = fix
        self._partial = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines received so far (possibly b""), rewritten where needed."""
        data = self._partial + chunk if self._partial else chunk
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        complete = data[:cut]
        if b'"usage"' not in complete:
            return complete
        return b"\n".join(self._line(line) for line in complete.split(b"\n"))

    def flush(self) -> bytes:
        """Whatever partial line is left at end of stream (relayed as is)."""
        tail, self._partial = self._partial, b""
        return self._line(tail) if tail else b""

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(_DATA) or b'"usage"' not in line:
            return line
        try:
            event = _json_decode(line[len(_DATA):])
        except msgspec.DecodeError:
            return line
        usage = event.get("usage") if isinstance(event, dict) else None
        if not isinstance(usage, dict):
            return line
        self._fix(usage)
        return _DATA + _json_encode(event)
