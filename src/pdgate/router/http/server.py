"""Serving the router app in this process: uvicorn with the router's server protocol
(client deadlines, the pending-connection cap), the drain on SIGTERM
(router/http/drain.py), graceful shutdown and a quiet collector.
`pdgate router` calls it once; each `--workers` worker calls it on its own socket."""

from __future__ import annotations

import gc
import socket
from typing import Any

from pdgate.router.config import RouterConfig
from pdgate.router.http.app import create_app
from pdgate.router.http.client_deadlines import header_deadline_protocol
from pdgate.router.http.drain import Drain, DrainingServer, EarlySignals
from pdgate.router.logs import setup_logging

__all__ = ["serve", "setup_process_logging"]


def setup_process_logging(config: RouterConfig) -> None:
    """The process's log setup from `config` (uvicorn's loggers folded in)."""
    setup_logging(config.log_level, config.log_format)


def serve(config: RouterConfig, *, app: Any = None, drain: Drain | None = None,
          sock: socket.socket | None = None, worker: int | None = None,
          early: EarlySignals | None = None) -> int:
    """Serve `config` until SIGINT/SIGTERM (SIGTERM: after `config.drain_delay_s` of
    draining): on `config.host`/`config.port`, or on `sock` (bound, not yet listening: a
    `--workers` worker's SO_REUSEPORT socket). `worker` is that worker's index, sent back in
    the `X-Pdgate-Worker` response header. `app`: the router app already built for `config`
    with `drain` (default: build both here). `early`: the handler a caller installed
    before it, holding SIGINT/SIGTERM that arrived meanwhile (default: installed here)."""
    import uvicorn

    if early is None:
        early = EarlySignals()
        early.install()
    setup_process_logging(config)
    if app is None:
        drain = Drain()
        app = create_app(config, drain=drain)
    drain = drain or Drain()
    if worker is not None:
        app = _WorkerHeader(app, worker)
    server = DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, loop="auto",
        http=header_deadline_protocol(config.header_timeout_s,
                                      config.max_pending_connections),
        timeout_graceful_shutdown=int(config.shutdown_timeout_s + 0.999),
        log_level=config.log_level, access_log=False, log_config=None,
        # Nothing in the router reads the client address or scheme that uvicorn's proxy
        # headers middleware rewrites: it would be one more layer on every request.
        proxy_headers=False,
    ), drain, config.drain_delay_s, early)
    _quiet_gc()
    # asyncio's create_server listens on `sock` once the lifespan is up: until then the
    # kernel sends this port's connections to the workers already serving.
    server.run(sockets=None if sock is None else [sock])
    return 0


def _quiet_gc() -> None:
    """Fewer, cheaper garbage collections in a serving process: everything built so far
    (modules, the app, its config) is frozen out of the collector's scans, and the young
    generation is collected every 20,000 allocations instead of 700. A request allocates
    thousands of short-lived objects that reference counting frees; at the default
    threshold the collector ran several times per request and its full passes showed up
    as p99 stalls."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


class _WorkerHeader:
    """ASGI wrapper adding `X-Pdgate-Worker: <index>` to every HTTP response."""

    def __init__(self, app: Any, index: int) -> None:
        self._app = app
        self._header = (b"x-pdgate-worker", str(index).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def add_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self._app(scope, receive, add_header)
