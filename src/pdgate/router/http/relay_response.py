"""The SSE answer of a completion route: the decode stream relayed to the client.

`RelayResponse` writes each chunk straight to the client's transport when the router's own
server protocol serves the request (`ChunkWriter`, router/http/client_deadlines.py); elsewhere
through ASGI `send` under `WriteDeadlineSend`. Either way the start and the end of the
response are ASGI messages (the access log and tracing see them), a client that stops
reading is cut after the write deadline, one that leaves ends the relay at once
(`DisconnectWatch`), and the upstream stream is released however the relay ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from pdgate.router.flows.base import StreamResult
from pdgate.router.http.client_deadlines import (
    CONNECTION_LOST,
    ChunkWriter,
    SlowReader,
    WriteDeadlineSend,
)

__all__ = ["DisconnectWatch", "RelayResponse"]

log = logging.getLogger(__name__)
# Encoded once: no cache may keep a stream, and nginx must not buffer it.
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                (b"content-type", b"text/event-stream; charset=utf-8")]


class DisconnectWatch:
    """Cancels the task that made it once the client disconnects (`fired` is then True).
    `stop()` it when the guarded await is over; the caller `uncancel()`s after catching the
    cancellation it caused. Behind the router's own server protocol a callback on the
    connection's `CONNECTION_LOST` future does it; elsewhere a task waiting on `receive()`
    for `http.disconnect`."""

    __slots__ = ("_target", "_task", "_lost", "fired")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        target = asyncio.current_task()
        assert target is not None
        self._target = target
        self.fired = False
        self._task: asyncio.Future[None] | None = None
        self._lost: asyncio.Future[None] | None = (
            scope.get("extensions") or {}).get(CONNECTION_LOST, {}).get("future")
        if self._lost is not None:
            self._lost.add_done_callback(self._on_lost)
        else:
            self._task = asyncio.ensure_future(self._run(receive))

    async def _run(self, receive: Receive) -> None:
        await _wait_disconnect(receive)
        self._fire()

    def _on_lost(self, _lost: asyncio.Future[None]) -> None:
        self._fire()

    def _fire(self) -> None:
        self.fired = True
        self._target.cancel()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        elif self._lost is not None:
            self._lost.remove_done_callback(self._on_lost)

    def uncancel(self) -> None:
        self._target.uncancel()


class RelayResponse(Response):
    """An SSE response relaying `result`'s chunks (status 200, `headers` plus the SSE
    content type and no-cache, no-buffering headers); the upstream stream is always
    released, however the relay ends (finished, client gone, cancelled, or never started).
    `on_done` and every `on_close` callback run then.

    Not Starlette's `StreamingResponse`: its __call__ (ASGI < 2.4, as uvicorn speaks) runs
    the relay and a disconnect listener in an anyio task group per stream, and every chunk
    travels as an ASGI message; here one watcher cancels the relay when the client leaves,
    and chunks go to the transport."""

    def __init__(self, result: StreamResult, headers: dict[str, str],
                 on_done: Callable[[], None], write_timeout_s: float = 30.0) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in headers.items()]
        self.raw_headers += _SSE_HEADERS
        self._write_timeout_s = write_timeout_s
        self._result = result
        self._on_done = on_done
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the stream is over, however it ended."""
        self._on_close.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = DisconnectWatch(scope, receive)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            writer = ChunkWriter.of(scope, self._write_timeout_s)
            if writer is not None:
                async for chunk in self._result.chunks:
                    await writer.write(chunk)
                await writer.drain()
                await send(_end())
            else:
                await self._relay_by_messages(send)
        except asyncio.CancelledError:
            if not watch.fired:
                raise
            watch.uncancel()  # the client left: the stream just ends
        except SlowReader as exc:
            # Returning with the response unfinished makes the server close the connection.
            log.warning("stream cut: %s", exc)
        finally:
            watch.stop()
            try:
                await self._result.chunks.aclose()
            finally:
                self._result.close()
                self._on_done()
                for callback in self._on_close:
                    callback()

    async def _relay_by_messages(self, send: Send) -> None:
        """The relay behind another server: one ASGI message per chunk."""
        deadline_send = WriteDeadlineSend(send, self._write_timeout_s)
        try:
            async for chunk in self._result.chunks:
                await deadline_send({"type": "http.response.body", "body": chunk,
                                     "more_body": True})
            await deadline_send(_end())
        finally:
            deadline_send.close()


def _end() -> Message:
    return {"type": "http.response.body", "body": b"", "more_body": False}


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
