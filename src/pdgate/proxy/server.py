"""`NotifyServer`: the zmq PULL socket that feeds KV-ready messages to the waiters.

Runs inside its owner's event loop: the router's lifespan (``async with NotifyServer(...)``)
or the standalone ``python -m pdgate.proxy``. No HTTP, no engine logic.

Anyone who can reach the port can send frames, so the receive loop is built to stay useful
under a flood of junk. zmq's PULL socket fair-queues between connected peers, one message
per peer in turn, so a real engine's notices interleave with a flooding peer's as long as
the loop keeps draining. Each flooding connection is held back by `rcv_hwm` messages whose
frames are at most `max_msg_bytes` each (zmq bounds neither the frames of one message nor
the number of connections: only the network in front of the port can). Per message the
cheap checks come first (frame count, payload size, MAC size, then the HMAC, then the
two-phase decode; see proxy.wire), so junk costs microseconds. The loop hands the event loop
back after `batch` messages or `batch_time_s`, whichever comes first, so woken waiters (and,
in the router, HTTP requests) run during a flood. Nothing a peer sends can end the loop:
decode failures are counted `WireError`s, and any other exception is a bug that is counted
(``error``), logged at most once a second, and survived.
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

from pdgate.proxy.config import ProxyConfig
from pdgate.proxy.memory import heap_trimmer
from pdgate.proxy.metrics import ProxyMetrics
from pdgate.proxy.waiters import WaiterTable
from pdgate.proxy.wire import KIND_UNKNOWN, FrameDecoder, KVReady, WireError

log = logging.getLogger(__name__)


def _pollin(sock: zmq.Socket[bytes]) -> bool:
    events = sock.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)

_PORT_ZERO = re.compile(r":0$")
_BUG_LOG_INTERVAL_S = 1.0


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
        self._decoder = FrameDecoder(config.secret_bytes(),
                                     max_frame_bytes=config.max_frame_bytes)
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._endpoint = ""
        self.frames_received = 0  # every message taken off the socket, good or bad
        self._quiet_until = 0.0  # bugs are logged at most once per _BUG_LOG_INTERVAL_S

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
                except Exception:  # a bug must not end the loop every request depends on
                    self._log_bug("receiving")
                    await asyncio.sleep(0.01)
        finally:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(fd)

    def _drain(self, shadow: zmq.Socket[bytes]) -> bool:
        """Handle queued messages until none is left (False) or this turn's budget, `batch`
        messages or `batch_time_s`, is spent (True: more may wait)."""
        # Counted once per turn: a Prometheus increment costs more than a junk frame's checks.
        counts: dict[tuple[str, str], int] = {}
        deadline = time.perf_counter() + self.config.batch_time_s
        try:
            for _ in range(self.config.batch):
                frames = _recv(shadow)
                if frames is None:
                    return False
                labels = self._handle(frames, time.perf_counter())
                counts[labels] = counts.get(labels, 0) + 1
                if time.perf_counter() > deadline:
                    return True
            return True
        finally:
            for (kind, result), n in counts.items():
                self.metrics.message(kind, result, n)

    def _handle(self, frames: list[bytes], received: float) -> tuple[str, str]:
        """Decode and dispatch one message; its ``messages_total`` labels (kind, result)."""
        self.frames_received += 1
        try:
            kind, msg = self._decoder.decode(frames)
        except WireError as exc:
            log.debug("dropped frame: %s", exc)
            return exc.kind, exc.reason
        except Exception:  # decoding is the sender's problem, never the loop's
            self._log_bug("decoding a frame")
            return KIND_UNKNOWN, "error"
        if not isinstance(msg, KVReady):
            return kind, "ok"
        try:
            result = self.waiters.notify(msg, received=received, nbytes=len(frames[0]))
        except Exception:  # a bug must not kill the loop that every request depends on
            self._log_bug(f"dispatching the notice for {msg.request_id!r}")
            return kind, "error"
        return kind, msg.status if result in ("delivered", "early") else result

    def _log_bug(self, what: str) -> None:
        # Input that triggers a bug may come by the million: log the first of each second.
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + _BUG_LOG_INTERVAL_S
            log.exception("KV-ready proxy: bug while %s; counted as result=error (further "
                          "ones within %gs are not logged)", what, _BUG_LOG_INTERVAL_S)


def _recv(shadow: zmq.Socket[bytes]) -> list[bytes] | None:
    """The frames of one queued message, or None when there is none.

    Only the first three frames are copied; the rest of a many-frame message is received
    without copying and discarded (the decoder refuses anything over two frames anyway).
    """
    try:
        frames = [shadow.recv(zmq.NOBLOCK)]
    except zmq.Again:
        return None
    while shadow.getsockopt(zmq.RCVMORE):
        if len(frames) < 3:
            frames.append(shadow.recv(zmq.NOBLOCK))
        else:
            shadow.recv(zmq.NOBLOCK, copy=False)
    return frames
