"""`pdgate router --workers N`: N shared-nothing router processes on one port.

The parent validates the config, reserves the port and starts N workers (`python -m
router.workers INDEX`, config as JSON on stdin: secrets never reach argv or the
environment). Each worker binds the port itself with SO_REUSEPORT, so the kernel spreads
new client connections over them, and builds everything the single-process router builds:
its own engine session, health checks, circuit breakers and routing state.

What is per worker:
- Admission: `max_concurrent_requests` and `max_queued_requests` are split so the workers
  together admit what was configured: worker i gets `total // N`, plus one while
  `i < total % N`. A worker gets at least 1 slot, so the sum exceeds the setting only when
  `max_concurrent_requests < N`; a queue of 0 stays 0 everywhere.
- KV-ready proxy (notify mode): worker i binds `notify_bind`'s port + i (port 0: each gets
  a free port) and advertises its own endpoint in its own requests, so a prefill engine's
  notice reaches the worker that waits for it.
- `/metrics`: every worker's series, each labelled `worker="<index>"` (each worker
  publishes its own to a directory the supervisor made; router/worker_metrics.py), so one
  scrape shows the whole pod; the response header `X-Pdgate-Worker` says which one served
  a request (index 0..N-1).

Supervision: SIGTERM/SIGINT to the parent stop every worker gracefully (each gets SIGTERM,
so each drains for `drain_delay_s` as a single router does (router/http/drain.py), then
has `shutdown_timeout_s` to finish its requests; SIGKILL 5 s after both) and the parent
exits 0. A
worker that dies on its own is restarted after a backoff that doubles from 0.5 s up to
30 s, and resets once a worker has served for a minute; the parent itself keeps running.
Workers get SIGTERM if the parent dies (Linux parent-death signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import msgspec

from pdgate.router.config import RouterConfig
from pdgate.router.worker_metrics import DIR_ENV, INDEX_ENV

__all__ = ["run_workers", "split_limit", "worker_config"]

log = logging.getLogger("pdgate.router.http.workers")
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0
_HEALTHY_AFTER_S = 60.0  # a worker up this long resets its restart backoff
_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1


def split_limit(total: int, workers: int, index: int, minimum: int) -> int:
    """Worker `index`'s share of `total` (the shares add up to `total`; never below
    `minimum`)."""
    return max(minimum, total // workers + (1 if index < total % workers else 0))


def worker_config(config: RouterConfig, index: int) -> RouterConfig:
    """The settings of worker `index` (0-based) of `config.workers`."""
    n = config.workers
    return msgspec.structs.replace(
        config,
        max_concurrent_requests=split_limit(config.max_concurrent_requests, n, index, 1),
        max_queued_requests=split_limit(config.max_queued_requests, n, index, 0),
        notify_bind=_nth_endpoint(config.notify_bind, index),
    )


def _nth_endpoint(endpoint: str, index: int) -> str:
    """`tcp://host:port` with port + index (port 0, or no port number, unchanged)."""
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0 or "://" not in head:
        return endpoint
    return f"{head}:{int(port) + index}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    backoff_s: float = _BACKOFF_FIRST_S
    restart_at: float | None = None


class _Supervisor:
    def __init__(self, config: RouterConfig, metrics_dir: str) -> None:
        self._config = config
        self._workers = [_Worker(i) for i in range(config.workers)]
        self._stopping = False
        self._metrics_dir = metrics_dir

    def request_stop(self, signum: int, _frame: object) -> None:
        self._stopping = True

    def _start(self, w: _Worker) -> None:
        body = msgspec.json.encode(worker_config(self._config, w.index))
        w.proc = subprocess.Popen(
            [sys.executable, "-m", "pdgate.router.http.workers", str(w.index)],
            stdin=subprocess.PIPE,
            env={**os.environ, DIR_ENV: self._metrics_dir, INDEX_ENV: str(w.index)})
        assert w.proc.stdin is not None
        w.proc.stdin.write(body)
        w.proc.stdin.close()
        w.started_at, w.restart_at = time.monotonic(), None
        log.info("worker %d started (pid %d)", w.index, w.proc.pid)

    def _check(self, w: _Worker, now: float) -> None:
        if w.proc is None or w.restart_at is not None:
            if w.restart_at is not None and now >= w.restart_at:
                self._start(w)
            return
        code = w.proc.poll()
        if code is None:
            if now - w.started_at >= _HEALTHY_AFTER_S:
                w.backoff_s = _BACKOFF_FIRST_S
            return
        log.error("worker %d (pid %d) exited with %s; restarting in %.1f s", w.index,
                  w.proc.pid, code, w.backoff_s)
        w.restart_at = now + w.backoff_s
        w.backoff_s = min(w.backoff_s * 2, _BACKOFF_MAX_S)

    def run(self) -> int:
        for w in self._workers:
            self._start(w)
        while not self._stopping:
            now = time.monotonic()
            for w in self._workers:
                self._check(w, now)
            time.sleep(_POLL_S)
        self._stop_all()
        return 0

    def _stop_all(self) -> None:
        live = [w.proc for w in self._workers if w.proc is not None and w.proc.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = (time.monotonic() + self._config.drain_delay_s
                    + self._config.shutdown_timeout_s + 5.0)
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not stop in time; killing it", proc.pid)
                proc.kill()
                proc.wait()


def run_workers(config: RouterConfig) -> int:
    """Supervise `config.workers` router processes until SIGTERM/SIGINT; the exit status.
    `config` must already be validated (the caller built the app once to check it)."""
    # Held for the parent's lifetime: resolves port 0 to one port for every worker, and
    # keeps another user's process from taking the port while a worker restarts.
    reserved = listen_socket(config.host, config.port)
    config = msgspec.structs.replace(config, port=reserved.getsockname()[1])
    metrics_dir = tempfile.mkdtemp(prefix="pdgate-worker-metrics-")
    supervisor = _Supervisor(config, metrics_dir)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, supervisor.request_stop)
    log.info("serving on %s:%d with %d workers", config.host, config.port, config.workers)
    try:
        return supervisor.run()
    finally:
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def worker_main(index: int) -> int:
    """One worker: read its config from stdin, serve on the shared port."""
    from pdgate.router.http.drain import EarlySignals

    early = EarlySignals()  # a stop while this worker starts is acted on once it serves
    early.install()
    _die_with_parent()
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=RouterConfig)
    from pdgate.router.http.server import serve  # the single-process serving path

    sock = listen_socket(config.host, config.port)
    return serve(config, sock=sock, worker=index, early=early)


if __name__ == "__main__":
    sys.exit(worker_main(int(sys.argv[1])))
