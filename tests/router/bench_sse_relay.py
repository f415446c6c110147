"""CPU cost of the decode relay per stream: engine bytes -> `EngineStream.chunks()` ->
`relay_chunks` (with and without the usage rewriter), no sockets.

Not collected by pytest. Run `python -m tests.router.bench_sse_relay` on a quiet machine;
the same file runs against older checkouts (it adapts to `EngineStream`'s signature), so
before/after numbers come from one script:

    git worktree add /tmp/old <rev> && (cd /tmp/old && python -m tests.router.bench_sse_relay)

Workloads: 500 events of 50-byte tokens as vLLM sends them (one event per read, and the
same bytes cut at 1,400-byte boundaries), the final usage chunk of a 2,000-word prompt
echoed back (a ~13 KB line, cut at 1,400 bytes), and one long line cut at 64 KiB.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from pdgate.router.engines.client import EngineStream
from pdgate.router.engines.sse import UsageRewriter
from pdgate.router.flows.common import relay_chunks
from pdgate.router.metrics import RouterMetrics

TOKEN = "x" * 50


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = iter(chunks)

    async def readany(self) -> bytes:
        return next(self._chunks, b"")


class _Resp:
    content_type = "text/event-stream"

    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(text: str | None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    choices = [] if text is None else [{"index": 0, "delta": {"content": text},
                                        "logprobs": None, "finish_reason": None}]
    return {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
            "created": 1700000000, "model": "tiny", "choices": choices, "usage": usage}


def tokens_stream() -> list[bytes]:
    usage = {"prompt_tokens": 2600, "completion_tokens": 500, "total_tokens": 3100}
    return [_event(_chunk(TOKEN)) for _ in range(500)] + [_event(_chunk(None, usage)),
                                                          b"data: [DONE]\n\n"]


def cut(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def usage_echo_stream() -> list[bytes]:
    prompt = " ".join(f"word{i % 97}" for i in range(2000))
    usage = {"prompt_tokens": 2600, "completion_tokens": 1, "total_tokens": 2601}
    final = _chunk(None, usage)
    final["choices"] = [{"index": 0, "text": prompt, "finish_reason": "length"}]
    return cut(_event(final) + b"data: [DONE]\n\n", 1400)


def long_line_stream(size: int) -> list[bytes]:
    line = b'data: {"choices":[{"text":"' + b"y" * size + b'"}]}\n\ndata: [DONE]\n\n'
    return cut(line, 65536)


def _make_stream(chunks: list[bytes], max_line: int) -> EngineStream:
    params = inspect.signature(EngineStream).parameters
    if "max_line_bytes" in params:  # after the hostile-input bounds
        return EngineStream("http://bench", _Resp(chunks), 30.0,  # type: ignore[arg-type]
                            max_line_bytes=max_line)
    return EngineStream("http://bench", _Resp(chunks), 30.0)  # type: ignore[arg-type]


async def _relay(chunks: list[bytes], rewrite: bool, metrics: RouterMetrics,
                 max_line: int) -> int:
    def fix(usage: dict[str, Any]) -> None:
        usage["prompt_tokens"] = 7

    stream = _make_stream(chunks, max_line)
    rewriter = UsageRewriter(fix) if rewrite else None
    n = 0
    async for out in relay_chunks(stream.chunks(), rewriter, metrics, time.perf_counter(),
                                  "bench"):
        n += len(out)
    return n


def bench(name: str, make: Callable[[], list[bytes]], rounds: int,
          max_line: int = 4 << 20) -> None:
    metrics = RouterMetrics.create(CollectorRegistry())

    async def best_of(rewrite: bool) -> float:
        best = float("inf")
        for _ in range(rounds):
            chunks = make()
            t0 = time.process_time()  # CPU time: other load on the box inflates it less
            await _relay(chunks, rewrite, metrics, max_line)
            best = min(best, time.process_time() - t0)
        return best

    for rewrite in (False, True):
        best = asyncio.run(best_of(rewrite))
        print(f"{name:<48} rewrite={'yes' if rewrite else 'no ':<3} "
              f"{best * 1e3:9.3f} ms CPU/stream (best of {rounds})", flush=True)


def main() -> None:
    print(sys.version.split()[0])
    bench("500 x 50-byte tokens, 1 event per read", tokens_stream, 200)
    bench("500 x 50-byte tokens, 1400-byte reads", lambda: cut(b"".join(tokens_stream()),
                                                              1400), 200)
    bench("2,000-word prompt usage chunk, 1400-byte reads", usage_echo_stream, 200)
    if "--short" in sys.argv:
        return
    for mib in (8, 16, 32):
        bench(f"one {mib} MiB line, 64 KiB reads", lambda m=mib: long_line_stream(m << 20),  # type: ignore[misc]
              1, max_line=64 << 20)


if __name__ == "__main__":
    main()
