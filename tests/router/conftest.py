"""Router test fixtures: fake engines and a real router, both on loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from pdgate.router.config import RouterConfig
from pdgate.router.http.app import create_app
from pdgate.router.http.client_deadlines import header_deadline_protocol
from pdgate.router.input.tokenization import PromptTokenizer, load_tokenizer
from tests.router.fake_engine import FakeEngine

MODEL = "tiny"


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> PromptTokenizer:
    return load_tokenizer(str(tiny_model_dir), str(tiny_model_dir), None)


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    engines: list[FakeEngine] = []

    async def make(**knobs: Any) -> FakeEngine:
        engine = FakeEngine(**knobs)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


@dataclass
class RunningRouter:
    url: str
    config: RouterConfig
    registry: CollectorRegistry
    client: httpx.AsyncClient

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


def router_config(
    tiny_model_dir: Path, prefill: list[FakeEngine], decode: list[FakeEngine], **kw: Any
) -> RouterConfig:
    fields: dict[str, Any] = {
        "model": str(tiny_model_dir),
        "served_model_name": [MODEL],
        "prefill": [e.url for e in prefill],
        "decode": [e.url for e in decode],
        "health_interval_s": 3600.0,  # tests drive health explicitly
        # The fake engines check nothing, so the router's own checks (context length,
        # template sandbox) are what these tests exercise; test_tokenize_when_needed.py
        # covers the default ("auto").
        "tokenize_prompts": "always",
    }
    fields.update(kw)
    return RouterConfig(**fields)


@contextlib.asynccontextmanager
async def serve(config: RouterConfig, tokenizer: PromptTokenizer) -> AsyncIterator[RunningRouter]:
    """Run the router app under uvicorn on an OS-assigned loopback port."""
    registry = CollectorRegistry()
    app = create_app(config, registry=registry, tokenizer=tokenizer)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1,
        http=header_deadline_protocol(config.header_timeout_s,
                                      config.max_pending_connections),
    ))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("router exited during startup")
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield RunningRouter(url, config, registry, client)
    finally:
        server.should_exit = True
        await task
        sock.close()


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `cond` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def wait_until_ready(client: httpx.AsyncClient, proc: asyncio.subprocess.Process) -> None:
    """Poll a router process's `/ready` (every 50 ms, up to 30 s) until it answers 200;
    fails at once if the process exits."""
    for _ in range(600):
        try:
            if (await client.get("/ready")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.returncode is None, "router exited"
        await asyncio.sleep(0.05)
    raise AssertionError("router not ready after 30 s")


def sse_events(text: str) -> list[Any]:
    """The events of an SSE body: JSON objects, and "[DONE]" as a string."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture
async def start_router(
    tiny_model_dir: Path, tokenizer: PromptTokenizer
) -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            prefill: list[FakeEngine], decode: list[FakeEngine], **kw: Any
        ) -> RunningRouter:
            config = router_config(tiny_model_dir, prefill, decode, **kw)
            return await stack.enter_async_context(serve(config, tokenizer))

        yield start


@pytest.fixture
async def pd(
    make_engine: Callable[..., Awaitable[FakeEngine]],
    start_router: Callable[..., Awaitable[RunningRouter]],
) -> tuple[FakeEngine, FakeEngine, RunningRouter]:
    """One prefill engine, one decode engine and a router in front of them."""
    p = await make_engine(engine_id="P0")
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d])
    return p, d, router


def engine_rid(engine: FakeEngine) -> str:
    """The request id the router sent `engine` on its first leg (the router's own id, never
    the client's X-Request-Id)."""
    return str(engine.requests[0].headers["X-Request-Id"])
