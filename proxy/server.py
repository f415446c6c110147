"""`NotifyServer`: the zmq PULL socket that feeds KV-ready messages to the waiters.

Runs inside its owner's event loop: the router's lifespan (``async with NotifyServer(...)``)
or the standalone ``python -m proxy``. No HTTP, no engine logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from types import TracebackType

import zmq
import zmq.asyncio

from proxy.config import ProxyConfig
from proxy.memory import heap_trimmer
from proxy.metrics import ProxyMetrics
from proxy.waiters import WaiterTable
from proxy.wire import FrameDecoder, KVReady, WireError

log = logging.getLogger(__name__)


def _pollin(sock: zmq.Socket[bytes]) -> bool:
    events = sock.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)

_PORT_ZERO = re.compile(r":0$")


class NotifyServer:
    """Binds a PULL socket, decodes each frame and dispatches it into a `WaiterTable`.

    Frames that fail to decode or authenticate are counted and dropped; the receive loop
    never stops on bad input. `start()` binds (errors surface there), `close()` stops the
    loop and the reaper and closes the socket with linger 0. The zmq context is created
    here and terminated on close unless the caller passes its own.
    """

    def __init__(
        self, config: ProxyConfig, *, metrics: ProxyMetrics | None = None,
        table: WaiterTable | None = None, context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config.validate()
        self.metrics = metrics if metrics is not None else ProxyMetrics.create()
        self.waiters = table if table is not None else WaiterTable(
            ttl_s=config.ttl_s, max_waiters=config.max_waiters, max_early=config.max_early,
            max_early_bytes=config.max_early_bytes, metrics=self.metrics,
            on_drained=heap_trimmer(),
        )
        self._decoder = FrameDecoder(config.secret_bytes())
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._endpoint = ""
        self.frames_received = 0  # every frame taken off the socket, good or bad

    @property
    def endpoint(self) -> str:
        """The bound endpoint with its real port, e.g. ``tcp://127.0.0.1:40123``."""
        if not self._endpoint:
            raise RuntimeError("NotifyServer is not started")
        return self._endpoint

    @property
    def advertised_endpoint(self) -> str:
        """`endpoint` with a wildcard host replaced by `config.advertise_host`, if set."""
        host = self.config.advertise_host
        if host is None:
            return self.endpoint
        scheme, _, rest = self.endpoint.partition("://")
        return f"{scheme}://{host}:{rest.rsplit(':', 1)[1]}"

    async def start(self) -> None:
        """Bind the socket and start the receive loop and the reaper."""
        sock = self._ctx.socket(zmq.PULL)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.config.rcv_hwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_msg_bytes)
            sock.bind(_PORT_ZERO.sub(":*", self.config.bind))
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sock = sock
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [
            asyncio.create_task(self._recv_loop(sock), name="proxy-recv"),
            asyncio.create_task(
                self.waiters.run_reaper(self.config.reap_interval_s), name="proxy-reaper"
            ),
        ]
        log.info("KV-ready proxy listening on %s", self._endpoint)

    async def close(self) -> None:
        """Stop the loops, close the socket (linger 0) and, if owned, the context."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    async def __aenter__(self) -> NotifyServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _recv_loop(self, sock: zmq.asyncio.Socket) -> None:
        # The socket is read synchronously (a shadow, NOBLOCK) whenever its FD signals, up
        # to `batch` frames, then the loop yields so woken waiters run before the next
        # batch. No zmq.asyncio future per receive: under a flood those futures' leftovers
        # were spread over the allocator's arenas and kept ~40 MiB from being returned
        # after the reaper emptied the table (bench/proxy.py); this way RSS comes back.
        shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fd = int(shadow.getsockopt(zmq.FD))  # type: ignore[arg-type]  # an int option
        loop.add_reader(fd, readable.set)
        try:
            while True:
                try:
                    if self._drain(shadow) or _pollin(shadow):
                        await asyncio.sleep(0)
                        continue
                    readable.clear()
                    if not _pollin(shadow):  # the FD is edge-triggered: re-check, then wait
                        await readable.wait()
                except zmq.ZMQError as exc:
                    if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                        return
                    log.warning("KV-ready proxy receive failed: %s", exc)
                    await asyncio.sleep(0.01)  # transient; do not spin on a persistent error
        finally:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(fd)

    def _drain(self, shadow: zmq.Socket[bytes]) -> bool:
        """Handle up to `batch` queued frames; True when the batch filled (more may wait)."""
        for _ in range(self.config.batch):
            try:
                frames = shadow.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._handle(frames, time.perf_counter())
        return True

    def _handle(self, frames: list[bytes], received: float) -> None:
        self.frames_received += 1
        try:
            kind, msg = self._decoder.decode(frames)
        except WireError as exc:
            self.metrics.message(exc.kind, exc.reason)
            log.debug("dropped frame: %s", exc)
            return
        if not isinstance(msg, KVReady):
            self.metrics.message(kind, "ok")
            return
        try:
            result = self.waiters.notify(msg, received=received, nbytes=len(frames[0]))
        except Exception:  # a bug must not kill the loop that every request depends on
            log.exception("KV-ready dispatch failed for %s", msg.request_id)
            self.metrics.message(kind, "error")
            return
        self.metrics.message(kind, "duplicate" if result == "duplicate" else msg.status)
