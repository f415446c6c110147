"""A shim engine served by a real uvicorn on a loopback port, in this process (tests)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from pdgate.engine_shim.engine import Engine, EngineConfig
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.server import ConnectorFactory, ServerSettings, create_app

MODEL = "tiny"
BLOCK_SIZE = 4
NUM_BLOCKS = 64  # 256 tokens: also the max model length
ADMISSION_TIMEOUT = 1.0


@dataclass
class Shim:
    url: str
    engine: Engine
    server: uvicorn.Server
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop

    def call(self, coro: Any) -> Any:
        """Run `coro` on the server's event loop (where the engine lives) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.split(" ", 1)[0] == name:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"metric {name} not exported")

    def wait_pool_full(self) -> None:
        """Freeing after a disconnect happens on the engine loop; wait for it (bounded)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            free = self.metric("pdgate_shim_kv_blocks_free")
            if free == self.metric("pdgate_shim_kv_blocks_capacity"):
                return
            time.sleep(0.05)
        pytest.fail(f"block pool not back to full: {free} of {NUM_BLOCKS} free")


def start_shim(
    model_dir: Path, *, connector_factory: ConnectorFactory | None = None,
    kv_digests: bool = False, kv_load_failure_policy: str = "recompute",
    settings: ServerSettings | None = None, admission_timeout: float = ADMISSION_TIMEOUT,
) -> Shim:
    config = EngineConfig(model=str(model_dir), served_model_names=(MODEL,),
                          block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, kv_digests=kv_digests,
                          admission_timeout=admission_timeout,
                          kv_load_failure_policy=kv_load_failure_policy)
    engine = Engine.load(config, ShimMetrics.create())
    app = create_app(engine, connector_factory=connector_factory, settings=settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    loops: list[asyncio.AbstractEventLoop] = []

    async def serve() -> None:
        loops.append(asyncio.get_running_loop())
        await server.serve(sockets=[sock])

    thread = threading.Thread(target=lambda: asyncio.run(serve()))
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "shim did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    return Shim(url, engine, server, thread, loops[0])


def stop_shim(shim: Shim) -> None:
    shim.server.should_exit = True
    shim.thread.join(timeout=30)
