"""A minimal, fast fake vLLM engine for router benchmarks (fixed responses, keep-alive).

It answers like a vLLM engine with the NixlConnector: a prefill request
(`kv_transfer_params.do_remote_decode`) gets `kv_transfer_params` back, anything else gets a
fixed completion (SSE when `"stream": true`). Raw asyncio + httptools on uvloop so the fake
costs far less CPU than the router it measures.

    python bench/fake_engine.py --port 8101
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httptools
import uvloop

_PREFILL_BODY = json.dumps({
    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
    "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9,
              "prompt_tokens_details": {"cached_tokens": 0}},
    "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "fake-p",
        "remote_request_id": "r", "remote_block_ids": [0, 1], "remote_host": "127.0.0.1",
        "remote_port": 5600, "tp_size": 1,
    },
}).encode()
_DECODE_BODY = json.dumps({
    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
    "choices": [{"index": 0, "text": " jumps over the lazy dog", "finish_reason": "length",
                 "logprobs": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
}).encode()
_SSE_CHUNK = (
    b'data: {"id":"cmpl-fake","object":"text_completion","created":0,"model":"fake",'
    b'"choices":[{"index":0,"text":" tok","finish_reason":null,"logprobs":null}]}\n\n'
)
_SSE_BODY = _SSE_CHUNK * 8 + b"data: [DONE]\n\n"
_MODELS = b'{"object":"list","data":[{"id":"fake","object":"model"}]}'


def _response(body: bytes, ctype: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
    return head % (ctype, len(body)) + body


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.body = bytearray()
        self.url = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        body, self.body = bytes(self.body), bytearray()
        if self.transport is None:
            return
        if self.url.startswith(b"/health"):
            self.transport.write(_response(b"{}"))
        elif self.url.startswith(b"/v1/models"):
            self.transport.write(_response(_MODELS))
        elif b'"do_remote_decode": true' in body or b'"do_remote_decode":true' in body:
            self.transport.write(_response(_PREFILL_BODY))
        elif b'"stream": true' in body or b'"stream":true' in body:
            self.transport.write(_response(_SSE_BODY, b"text/event-stream"))
        else:
            self.transport.write(_response(_DECODE_BODY))


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Conn, host, port, reuse_address=True, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    args = p.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
