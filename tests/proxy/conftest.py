"""Fixtures for the proxy tests: a started NotifyServer on a free loopback port, a sender."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import zmq

from pdgate.proxy import NotifySender, NotifyServer, ProxyConfig

SECRET = "s3cret-s3cret-s3cret"

ServerFactory = Callable[..., Any]


async def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Yield to the loop until `cond()` holds; fail after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.002)


def sample(server: NotifyServer, name: str, **labels: str) -> float:
    """Current value of one metric sample (0 when it was never touched)."""
    value = server.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
async def make_server() -> AsyncIterator[ServerFactory]:
    """Factory: `await make_server(**config_overrides)` returns a started server."""
    servers: list[NotifyServer] = []

    async def factory(**overrides: Any) -> NotifyServer:
        server = NotifyServer(ProxyConfig(bind="tcp://127.0.0.1:0", **overrides))
        await server.start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        await server.close()


@pytest.fixture
async def server(make_server: ServerFactory) -> NotifyServer:
    srv: NotifyServer = await make_server()
    return srv


@pytest.fixture
def sender() -> Iterator[NotifySender]:
    with NotifySender() as s:
        yield s


@pytest.fixture
def raw_push() -> Iterator[Callable[[str], zmq.Socket[bytes]]]:
    """Factory for bare PUSH sockets, to send frames no well-behaved sender would."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def connect(endpoint: str) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
        return sock

    yield connect
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
