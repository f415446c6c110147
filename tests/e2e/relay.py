"""A recording HTTP relay in front of an engine: what the router really sent where."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

# Hop-by-hop headers (RFC 9110 7.6.1) and what aiohttp sets itself.
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}


@dataclass
class Leg:
    """One request the relay passed on: its path, JSON body (None: not JSON) and headers
    (names lowercased: HTTP names are case-insensitive)."""

    path: str
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Relay:
    """Relays every request to `upstream` as is, recording it first."""

    upstream: str
    legs: list[Leg] = field(default_factory=list)
    url: str = ""

    def completions(self) -> list[Leg]:
        return [leg for leg in self.legs if leg.path.endswith("completions")]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = await request.json() if request.content_type == "application/json" and raw \
            else None
        self.legs.append(Leg(request.path, body,
                             {k.lower(): v for k, v in request.headers.items()}))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s, \
                s.request(request.method, self.upstream + request.path_qs, data=raw,
                          headers=headers) as up:
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


@contextlib.contextmanager
def running_relays(*upstreams: str) -> Iterator[list[Relay]]:
    """One relay per upstream URL on loopback, served from a thread of their own."""
    relays = [Relay(u) for u in upstreams]
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []

    async def start() -> None:
        for relay in relays:
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_route("*", "/{tail:.*}", relay._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            relay.url = f"http://127.0.0.1:{port}"
            runners.append(runner)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield relays
    finally:
        async def stop() -> None:
            for runner in runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
