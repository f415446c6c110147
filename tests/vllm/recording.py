"""Recording relays: loopback HTTP proxies in front of real engines that keep each JSON
body they forward, so a test sees exactly what the router asked P and D (the legs' fields)
while the engines answer as they would to the router itself."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

# Request headers an engine needs (the rest are the proxy's business).
_FORWARDED = ("authorization", "content-type", "x-request-id", "x-data-parallel-rank")


@dataclass
class Recorder:
    """A loopback HTTP proxy in front of one engine that records each JSON body by path."""

    target: str
    url: str = ""
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def seen(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b in self.bodies if p == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if raw and request.content_type == "application/json":
            self.bodies.append((request.path, json.loads(raw)))
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        assert self._session is not None
        async with self._session.request(request.method, self.target + request.path_qs,
                                         data=raw or None, headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items()
                if k.lower() in ("content-type", "x-request-id")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    _session: aiohttp.ClientSession | None = None


class Proxies:
    """Recorders for `targets` on their own event loop thread (the vLLM tests are sync)."""

    def __init__(self, targets: list[str]) -> None:
        self.recorders = [Recorder(t) for t in targets]
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> None:
        for rec in self.recorders:
            rec._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", rec.handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            rec.url = f"http://127.0.0.1:{port}"
            self._runners.append(runner)

    async def _stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        for rec in self.recorders:
            if rec._session is not None:
                await rec._session.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
