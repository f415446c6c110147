"""SSE from engines: check the protocol as bytes arrive, and rewrite `usage` objects.

Both classes work on whole lines and pass bytes on as soon as a line is complete; only a
trailing partial line is held back, as a list of pieces joined once when its newline
arrives, so a line costs time linear in its length however many reads it spans (joining
`held + chunk` on every read made one long line quadratic).

`EventChecker` is the engine-protocol check (a pure parser: `engines.py` turns its
`SSEProtocolError` into the router's error tree). `UsageRewriter` parses only lines that
mention `"usage"`, so ordinary token chunks cost one substring search.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["EventChecker", "SSELineTooLong", "SSEProtocolError", "UsageRewriter"]

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
_DATA = b"data: "
_DONE = b"[DONE]"
# SSE fields a relay may pass on untouched besides `data` (WHATWG "server-sent events").
_OTHER_FIELDS = (b"event:", b"id:", b"retry:")


class _Object(msgspec.Struct):
    """Decoding into a field-less Struct validates the JSON and that it is an object while
    skipping every value (about 3x cheaper than building a dict)."""


_check_object = msgspec.json.Decoder(_Object).decode


class SSEProtocolError(ValueError):
    """The engine's stream is not the OpenAI SSE protocol."""


class SSELineTooLong(SSEProtocolError):
    """One SSE line grew past the line limit (its bytes are not kept)."""


class EventChecker:
    """Checks an engine's `text/event-stream` body as it arrives.

    Rules (what vLLM and the engine shim send): every line is blank, a comment (`:`), an
    `event:`/`id:`/`retry:` field, or `data:` whose value is a JSON object or `[DONE]`;
    one event per `data:` line (multi-line data would not be one JSON value anyway);
    lines are UTF-8 and at most `max_line_bytes` long; `[DONE]` comes before the end and
    only blank lines or comments after it. `feed()` returns the complete lines received so
    far, as received (the chunk itself when it ends a line: no copy), and raises
    `SSEProtocolError` at the first violation; `end()` at end of stream.
    """

    def __init__(self, max_line_bytes: int) -> None:
        self._max = max_line_bytes
        self._held: list[bytes] = []  # pieces of the partial line, without any newline
        self._held_len = 0
        self.done = False  # `data: [DONE]` seen

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines of everything fed so far not yet returned (maybe b"")."""
        start = 0
        head = b""
        if self._held:
            nl = chunk.find(b"\n")
            if nl < 0:
                self._hold(chunk)
                return b""
            head = b"".join(self._held) + chunk[:nl + 1]  # the one copy of a long line
            self._held.clear()
            self._held_len = 0
            self._check_lines(head, 0, len(head))
            start = nl + 1
        end = chunk.rfind(b"\n", start) + 1
        if end == 0:
            end = start
        if end < len(chunk):
            self._hold(chunk[end:])
        if end == start:
            return head
        self._check_lines(chunk, start, end)
        body = chunk if start == 0 and end == len(chunk) else chunk[start:end]
        return head + body if head else body

    def end(self) -> bytes:
        """At end of stream: the unterminated last line, if any (checked, returned as is);
        raises `SSEProtocolError` when the stream never said `[DONE]`."""
        tail = b"".join(self._held)
        self._held.clear()
        self._held_len = 0
        if tail:
            if not tail.isascii():
                _check_utf8(tail, 0, len(tail))
            self._check_line(tail, 0, len(tail))
        if not self.done:
            raise SSEProtocolError("the stream ended without `data: [DONE]`")
        return tail

    def _hold(self, piece: bytes) -> None:
        self._held_len += len(piece)
        if self._held_len > self._max:
            self._held.clear()
            raise SSELineTooLong(f"an SSE line is longer than {self._max} bytes")
        self._held.append(piece)

    def _check_lines(self, buf: bytes, start: int, end: int) -> None:
        # `buf[end - 1]` is a newline, so every `find` below succeeds.
        ascii_only = buf.isascii()  # one fast pass; per-line UTF-8 decode only when needed
        pos = start
        while pos < end:
            nl = buf.find(b"\n", pos, end)
            if nl - pos > self._max:
                raise SSELineTooLong(f"an SSE line is longer than {self._max} bytes")
            if not ascii_only:
                _check_utf8(buf, pos, nl)
            self._check_line(buf, pos, nl)
            pos = nl + 1

    def _check_line(self, buf: bytes, pos: int, nl: int) -> None:
        if nl > pos and buf[nl - 1] == 0x0D:  # CRLF line ends
            nl -= 1
        if nl == pos or buf.startswith(b":", pos):
            return  # event boundary, or a comment (keep-alive)
        if not buf.startswith(b"data:", pos, nl):
            if self.done or not buf.startswith(_OTHER_FIELDS, pos, nl):
                raise SSEProtocolError(f"not an SSE data line: {_preview(buf, pos, nl)}")
            return
        if self.done:
            raise SSEProtocolError("data after `data: [DONE]`")
        p = pos + 5
        if p < nl and buf[p] == 0x20:
            p += 1
        if nl - p == len(_DONE) and buf.startswith(_DONE, p):
            self.done = True
            return
        try:
            _check_object(memoryview(buf)[p:nl])
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise SSEProtocolError(
                f"an SSE data event is not a JSON object: {_preview(buf, p, nl)}") from None


def _check_utf8(buf: bytes, pos: int, nl: int) -> None:
    try:
        str(memoryview(buf)[pos:nl], "utf-8")
    except UnicodeDecodeError as exc:
        raise SSEProtocolError(f"an SSE line is not UTF-8 ({exc.reason})") from None


def _preview(buf: bytes, pos: int, end: int) -> str:
    return repr(buf[pos:min(end, pos + 80)])


class UsageRewriter:
    """Feeds SSE bytes through, applying `fix(usage_dict)` to every chunk that carries a
    usage object. Call `feed()` per received chunk and `flush()` at the end."""

    def __init__(self, fix: Callable[[dict[str, Any]], None]) -> None:
        self._fix = fix
        self._held: list[bytes] = []  # pieces of the partial line (no newline in them)

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines received so far (possibly b""), rewritten where needed."""
        cut = chunk.rfind(b"\n") + 1
        if cut == 0:
            self._held.append(chunk)
            return b""
        if self._held:
            self._held.append(chunk[:cut])
            complete = b"".join(self._held)
            self._held.clear()
        else:
            complete = chunk if cut == len(chunk) else chunk[:cut]
        if cut < len(chunk):
            self._held.append(chunk[cut:])
        if b'"usage"' not in complete:
            return complete
        return b"\n".join(self._line(line) for line in complete.split(b"\n"))

    def flush(self) -> bytes:
        """Whatever partial line is left at end of stream (relayed as is)."""
        tail = b"".join(self._held)
        self._held.clear()
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
