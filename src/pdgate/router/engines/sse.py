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

from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["EventChecker", "SSELineTooLong", "SSEProtocolError", "UsageRewriter",
           "strip_usage_events"]

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
_DATA = b"data: "
_DONE = b"[DONE]"
_DATA_DONE = _DATA + _DONE
_NEXT_EVENT = b"\n\n" + _DATA  # between two `data:` events of one read
_USAGE = b'"usage"'
# SSE fields a relay may pass on untouched besides `data` (WHATWG "server-sent events").
_OTHER_FIELDS = (b"event:", b"id:", b"retry:")


class _Object(msgspec.Struct):
    """Decoding into a field-less Struct validates the JSON and that it is an object while
    skipping every value (about 3x cheaper than building a dict)."""


_check_object = msgspec.json.Decoder(_Object).decode
# What `_check_object` raises for a value that is not a JSON object; msgspec raises
# RecursionError for JSON nested deeper than the interpreter's recursion budget (~1000).
_NOT_AN_OBJECT = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


class SSEProtocolError(ValueError):
    """The engine's stream is not the OpenAI SSE protocol."""


class SSELineTooLong(SSEProtocolError):
    """One SSE line grew past the line limit (its bytes are not kept)."""


class EventChecker:
    """Checks an engine's `text/event-stream` body as it arrives.

    Rules (what vLLM and the engine shim send): every line is blank, a comment (`:`), an
    `event:`/`id:`/`retry:` field, or `data:` whose value is a JSON object or `[DONE]`;
    one event per `data:` line (multi-line data would not be one JSON value anyway);
    lines are UTF-8, at most `max_line_bytes` long, with no CR inside (a client's parser
    would end the line there); `[DONE]` comes before the end. `feed()` returns the
    complete lines received so far, as received (the chunk itself when it ends a line: no
    copy), and raises `SSEProtocolError` at the first violation; `end()` at end of stream.

    The stream ends at its `[DONE]` event: `finished` once the `data: [DONE]` line and the
    blank line after it were returned. Nothing after that is checked or returned; any byte
    of it sets `trailing` (the engine went on talking: its connection is not reused). A
    line other than the blank one right after `[DONE]` ends the stream there too, with the
    blank line the event needs added.
    """

    def __init__(self, max_line_bytes: int) -> None:
        self._max = max_line_bytes
        self._held: list[bytes] = []  # pieces of the partial line, without any newline
        self._held_len = 0
        self.done = False  # `data: [DONE]` seen
        self.finished = False  # ... and its event returned whole: the stream is over
        self.trailing = False  # bytes came after the `[DONE]` event (never returned)
        self._blank_after_done = True  # the `[DONE]` event ended with its blank line

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines of everything fed so far not yet returned (maybe b"")."""
        if self.finished:
            self.trailing = self.trailing or bool(chunk)
            return b""
        if (not self._held and not self.done and chunk.startswith(_DATA)
                and chunk.endswith(b"\n\n") and chunk.find(b"\n") == len(chunk) - 2
                and chunk.isascii() and b"\r" not in chunk):
            # The hot path, how engines write: one whole `data: {...}` event per read (the
            # JSON decoder takes the trailing newlines as whitespace).
            try:
                _check_object(chunk[6:])
                return chunk
            except _NOT_AN_OBJECT:
                pass  # `[DONE]`, or a bad event: the general path says which
        end = chunk.rfind(b"\n") + 1
        if end == 0:  # still inside one line
            self._hold(chunk)
            return b""
        done = chunk if end == len(chunk) else chunk[:end]
        if self._held:  # the one copy of a line that spanned reads
            self._held.append(done)
            done = b"".join(self._held)
            self._held.clear()
            self._held_len = 0
        if end < len(chunk):
            self._hold(chunk[end:])
        cut = self._check_lines(done)
        if self.finished and (cut < len(done) or self._held):
            self.trailing = True
            self._held.clear()
            self._held_len = 0
            if cut < len(done):
                # The client's SSE parser dispatches `[DONE]` only at a blank line.
                return done[:cut] if self._blank_after_done else done[:cut] + b"\n"
        return done

    def end(self) -> bytes:
        """At end of stream: the unterminated last line, if any (checked, returned as is);
        raises `SSEProtocolError` when the stream never said `[DONE]`."""
        tail = b"".join(self._held)
        self._held.clear()
        self._held_len = 0
        if tail and self.done:  # a partial line after `[DONE]`: not part of the stream
            self.trailing = self.finished = True
            return b""
        if tail:
            if not tail.isascii():
                _check_utf8(tail)
            self._check_line(tail)
        if not self.done:
            raise SSEProtocolError("the stream ended without `data: [DONE]`")
        return tail

    def _hold(self, piece: bytes) -> None:
        self._held_len += len(piece)
        if self._held_len > self._max:
            self._held.clear()
            self._held_len = 0
            raise SSELineTooLong(f"an SSE line is longer than {self._max} bytes")
        self._held.append(piece)

    def _check_lines(self, part: bytes) -> int:
        """Check whole lines (`part` ends with a newline); the length of what belongs to
        the stream: all of `part`, or up to the end of its `[DONE]` event."""
        # bytes.split and slicing run in C; a token event costs a few C calls plus one
        # skipping JSON decode.
        if (not self.done and part.startswith(_DATA) and b"\r" not in part
                and self._only_events(part)):
            return len(part)
        lines = part.split(b"\n")  # anything else, line by line: the check names the fault
        lines.pop()  # the empty piece after the last newline
        if len(part) > self._max and max(map(len, lines)) > self._max:
            raise SSELineTooLong(f"an SSE line is longer than {self._max} bytes")
        if not part.isascii():  # one fast pass; per-line UTF-8 decode only when needed
            for line in lines:
                _check_utf8(line)
        plain = b"\r" not in part  # else every line takes the careful path
        pos = 0  # where `line` starts in `part`
        for line in lines:
            if self.done:  # the line after `data: [DONE]`: the stream ends with it or here
                self.finished = True
                self._blank_after_done = line in (b"", b"\r")
                return pos + len(line) + 1 if self._blank_after_done else pos
            pos += len(line) + 1
            if plain and line.startswith(_DATA) and line != _DATA_DONE:
                try:
                    _check_object(line[6:])  # a token event
                    continue
                except _NOT_AN_OBJECT:
                    pass
            self._check_line(line)
        return pos

    def _only_events(self, part: bytes) -> bool:
        """True when `part` (no CR) is nothing but whole `data: <payload>` events in UTF-8,
        every payload a JSON object but a last `[DONE]` (then noted): how engines send. The
        decoder runs over the payloads from C (`map`), without a Python step per line.
        False: the line-by-line check decides (and names the fault)."""
        payloads = part[len(_DATA):-2].split(_NEXT_EVENT)
        # No payload may hold a newline (JSON takes one as whitespace; SSE ends the line
        # there). A join and memchr cost far less than bytes.count's byte-by-byte loop.
        if not part.endswith(b"\n\n") or b"\n" in b"".join(payloads):
            return False
        if not part.isascii():
            try:
                part.decode()  # one pass for every line
            except UnicodeDecodeError:
                return False
        if len(part) > self._max and max(map(len, payloads)) + len(_DATA) > self._max:
            raise SSELineTooLong(f"an SSE line is longer than {self._max} bytes")
        done = payloads[-1] == _DONE
        if done:
            payloads.pop()
        try:
            deque(map(_check_object, payloads), 0)
        except _NOT_AN_OBJECT:
            return False
        self.done = self.finished = done  # `[DONE]` came last, with its blank line
        return True

    def _check_line(self, line: bytes) -> None:
        """Every line but a valid `data: {...}` one (see `_check_lines`)."""
        if line.endswith(b"\r"):  # CRLF line ends
            line = line[:-1]
        if b"\r" in line:  # a lone CR ends an SSE line: the client would split it there
            raise SSEProtocolError(f"a CR inside an SSE line: {line[:80]!r}")
        if not line or line.startswith(b":"):
            return  # event boundary, or a comment (keep-alive)
        if not line.startswith(b"data:"):
            if self.done or not line.startswith(_OTHER_FIELDS):
                raise SSEProtocolError(f"not an SSE data line: {line[:80]!r}")
            return
        if self.done:
            raise SSEProtocolError("data after `data: [DONE]`")
        payload = line[6:] if line.startswith(_DATA) else line[5:]
        if payload == _DONE:
            self.done = True
            return
        try:
            _check_object(payload)
        except _NOT_AN_OBJECT:
            raise SSEProtocolError(
                f"an SSE data event is not a JSON object: {payload[:80]!r}") from None


def _check_utf8(line: bytes) -> None:
    try:
        line.decode()
    except UnicodeDecodeError as exc:
        raise SSEProtocolError(f"an SSE line is not UTF-8 ({exc.reason})") from None


class UsageRewriter:
    """Feeds SSE bytes through, applying `fix(usage_dict)` to every chunk that carries a
    usage object. Call `feed()` per received chunk and `flush()` at the end."""

    def __init__(self, fix: Callable[[dict[str, Any]], None]) -> None:
        self._fix = fix
        self._held: list[bytes] = []  # pieces of the partial line (no newline in them)

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines received so far (possibly b""), rewritten where needed."""
        complete = self.lines(chunk)
        return self.rewrite(complete) if _USAGE in complete else complete

    def lines(self, chunk: bytes) -> bytes:
        """`feed` without the rewrite: the complete lines received so far (possibly b"")
        as they came; a caller that searches them for usage itself `rewrite`s those."""
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
        return complete

    def rewrite(self, complete: bytes) -> bytes:
        """`complete` (whole lines) with every usage object fixed."""
        head, rest = split_at_usage(complete)
        return b"\n".join([*head, *(self._line(line) for line in rest.split(b"\n"))])

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
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return line
        usage = event.get("usage") if isinstance(event, dict) else None
        if not isinstance(usage, dict):
            return line
        self._fix(usage)
        return _DATA + _json_encode(event)


def strip_usage_events(lines: bytes) -> bytes:
    """`lines` (whole SSE lines) without the usage-only event (`"choices": []` plus a usage
    object) and the blank line that ends it: what a client that did not ask for
    `stream_options.include_usage` gets from vLLM. Other lines pass untouched."""
    if b'"usage"' not in lines:
        return lines
    head, rest = split_at_usage(lines)
    out = list(head)
    dropped = False
    for line in rest.split(b"\n"):
        if dropped and not line:
            dropped = False
            continue
        dropped = line.startswith(_DATA) and b'"usage"' in line and _usage_only(line)
        if not dropped:
            out.append(line)
    return b"\n".join(out)


def split_at_usage(lines: bytes) -> tuple[tuple[bytes, ...], bytes]:
    """`lines` (whole SSE lines) cut before the first line that mentions usage: the lines
    before it as one item (none when it is the first), and the rest. A relayed piece
    often holds many chunks and the usage one last (a short stream read at once): only
    the rest needs a look line by line."""
    at = lines.rfind(b"\n", 0, max(lines.find(_USAGE), 0)) + 1
    return ((lines[:at - 1],) if at else ()), lines[at:]


def _usage_only(line: bytes) -> bool:
    try:
        event = _json_decode(line[len(_DATA):])
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(event, dict) and event.get("choices") == [] and "usage" in event
