"""`RelayResponse` behind a server other than the router's own protocol (no `ChunkWriter`):
every chunk goes out as an ASGI message, the response ends with an empty last message,
and the upstream stream and the callbacks are released however the relay ends. Behind the
router's protocol the same answers are checked end to end (test_pull_flow.py and others)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.types import Message

from pdgate.router.flows.base import StreamResult
from pdgate.router.http.relay_response import RelayResponse


async def _chunks(closed: list[str]) -> AsyncGenerator[bytes, None]:
    try:
        yield b'data: {"a":1}\n\n'
        yield b"data: [DONE]\n\n"
    finally:
        closed.append("chunks")


async def _never(receive_forever: asyncio.Event) -> Message:
    await receive_forever.wait()
    return {"type": "http.disconnect"}


async def test_chunks_go_out_as_asgi_messages_and_everything_is_released() -> None:
    closed: list[str] = []
    sent: list[Message] = []
    result = StreamResult(_chunks(closed), lambda: closed.append("upstream"))
    response = RelayResponse(result, {"X-Request-Id": "r1"}, lambda: closed.append("done"))
    response.on_close(lambda: closed.append("slot"))
    forever = asyncio.Event()

    async def send(message: Message) -> None:
        sent.append(message)

    await response({"type": "http", "extensions": {}}, lambda: _never(forever), send)
    assert sent[0] == {"type": "http.response.start", "status": 200, "headers": [
        (b"x-request-id", b"r1"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"), (b"content-type", b"text/event-stream; charset=utf-8")]}
    assert [m["body"] for m in sent[1:]] == [b'data: {"a":1}\n\n', b"data: [DONE]\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]
    assert closed == ["chunks", "upstream", "done", "slot"]


async def test_a_client_gone_mid_stream_ends_the_relay_and_releases_it() -> None:
    closed: list[str] = []
    result = StreamResult(_chunks(closed), lambda: closed.append("upstream"))
    response = RelayResponse(result, {}, lambda: closed.append("done"))
    gone = asyncio.Event()

    async def send(message: Message) -> None:
        if message.get("body"):
            gone.set()  # the client leaves after the first chunk
            await asyncio.sleep(1)

    await asyncio.wait_for(response({"type": "http"}, lambda: _never(gone), send), 5)
    assert closed == ["chunks", "upstream", "done"]
