"""An open decode stream from an engine: SSE lines checked as they arrive, the first event
matched to the request it answers, how it ended told to the engine's breaker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from pdgate.router.engines.error_map import engine_message, translate
from pdgate.router.engines.http11 import Response
from pdgate.router.engines.replies import AnswerMismatch, check_answer_id
from pdgate.router.engines.sse import EventChecker, SSELineTooLong, SSEProtocolError
from pdgate.router.errors import (
    EngineError,
    EngineProtocolError,
    EngineReplyTooLarge,
    RouterError,
)

__all__ = ["EngineStream", "RefusalListener", "StreamListener"]

log = logging.getLogger(__name__)
_SSE_ERROR = b'data: {"error"'


class _EventId(msgspec.Struct):
    """The `id` of a stream event (the rest skipped, not built)."""

    id: Any = None


_decode_event_id = msgspec.json.Decoder(_EventId).decode

RefusalListener = Callable[[str], None]
"""Told the reason (`request_id`, `kv_params`, ...) of each engine answer refused because it
answered another request (the app counts them)."""


def first_event_id(lines: bytes) -> tuple[bool, object]:
    """(found, id) of the first data event in whole SSE `lines`; found False: none yet.
    Looks only as far as that event (the first read often holds the whole stream)."""
    at = lines.find(b"data:")
    while at > 0 and lines[at - 1] != 0x0A:  # not at a line start: look further
        at = lines.find(b"data:", at + 5)
    if at < 0:
        return False, None
    end = lines.find(b"\n", at)
    payload = lines[at + 5:end if end >= 0 else len(lines)].strip()
    if payload == b"[DONE]":
        return True, None
    try:
        return True, _decode_event_id(payload).id
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return True, None  # the checker already refused what is not JSON


StreamListener = Callable[[str, RouterError | None], None]
"""Told `(engine url, None)` when a decode stream ended as the protocol says, or `(engine
url, error)` when it failed after it was handed out (mid-stream: garbage, an over-long
line, a drop, an idle timeout). Failures `open_stream`/`check_start` raise are not
reported here: the caller that gets the exception records them (the orchestrator's retry).
"""


class EngineStream:
    """An open streaming response from an engine (status already checked as 2xx).

    Iterate `chunks()` for the body as it arrives, in whole SSE lines checked by
    `router.sse.EventChecker` (a partial line is held back until its newline); a
    violation raises `EngineProtocolError` / `EngineReplyTooLarge`. Always call `close()`
    (idempotent). A stream read to the end returns its connection to the pool; one closed
    early drops it.
    """

    def __init__(self, url: str, resp: Response, idle_timeout_s: float, *,
                 max_line_bytes: int, listener: StreamListener | None = None,
                 request_id: str | None = None,
                 on_refused: RefusalListener | None = None) -> None:
        self._url = url
        self._resp = resp
        self._idle = idle_timeout_s
        self._checker = EventChecker(max_line_bytes)
        self._listener = listener
        # The request this stream answers: its first event's `id` must name no other.
        self._request_id = request_id
        self._on_refused = on_refused
        self._id_checked = request_id is None
        self._eof = False  # the body was read to its end
        self._first = b""  # read by `check_start`, handed out first by `chunks`

    async def check_start(self, timeout_s: float) -> None:
        """Read up to the first complete line (within `timeout_s`) and raise `EngineError`
        if it is an SSE error event, `EngineProtocolError` if it breaks the protocol. vLLM
        answers a stream it cannot even start (e.g. a decode engine given KV params it
        cannot use) with HTTP 200 and one error event; checking here keeps that failure
        retryable and lets the client get a 502 instead of a 200 with an error inside. On
        any exception the stream is closed."""
        try:
            deadline = asyncio.get_running_loop().time() + timeout_s
            with translate(self._url, "decode first byte"):
                while not self._first and not self._eof:
                    self._first = self._accept(await self._resp.read_some(deadline))
            if self._first.startswith(_SSE_ERROR):
                event = self._first[len(b"data: "):].split(b"\n", 1)[0]
                raise EngineError(f"engine {self._url} failed the stream: "
                                  f"{engine_message(event)}")
        except BaseException:
            self.close()
            raise

    async def chunks(self) -> AsyncIterator[bytes]:
        """Checked body bytes as received; each wait is bounded by the idle timeout. Tells
        the listener how the stream ended (not when the reader stops early)."""
        try:
            if self._first:
                first, self._first = self._first, b""
                yield first
            resp, loop = self._resp, asyncio.get_running_loop()
            while not self._eof and not self._checker.finished:  # ends at its [DONE]
                with translate(self._url, "stream idle"):
                    raw = await resp.read_some(loop.time() + self._idle)
                if out := self._accept(raw):
                    yield out
        except RouterError as exc:
            self._tell(exc)
            if not self._checker.done:
                raise
            # The reader has its [DONE]: end its stream cleanly; `close` drops the connection.
            log.warning("%s (after [DONE]: the stream ends normally)", exc.message)
            return
        self._tell(None)

    def _accept(self, raw: bytes) -> bytes:
        """Check one read (b"": end of body); the complete lines to hand out."""
        try:
            if raw:
                out = self._checker.feed(raw)
            else:
                self._eof = True
                out = self._checker.end()
        except SSELineTooLong as exc:
            raise EngineReplyTooLarge(f"engine {self._url}: {exc}") from None
        except SSEProtocolError as exc:
            raise EngineProtocolError(f"engine {self._url} broke the SSE protocol: "
                                      f"{exc}") from None
        if not self._id_checked and out:
            self._check_id(out)
        return out

    def _check_id(self, lines: bytes) -> None:
        """Refuse the stream (nothing of it relayed) when its first event answers another
        request."""
        found, answered = first_event_id(lines)
        if not found:
            return
        self._id_checked = True
        try:
            check_answer_id(self._url, "stream event id", answered, self._request_id)
        except AnswerMismatch as exc:
            if self._on_refused is not None:
                self._on_refused(exc.reason)
            raise

    def _tell(self, error: RouterError | None) -> None:
        if self._listener is not None:
            self._listener(self._url, error)

    def close(self) -> None:
        """Release the upstream connection (to the pool if fully read, else closed)."""
        if self._eof:
            self._resp.release()
        elif self._checker.finished:  # pooled only if the body ends right after [DONE]
            self._resp.finish(self._checker.trailing)
        else:
            self._resp.close()
