"""One dedicated thread for every call on a (not thread-safe) NIXL agent, plus its poll loop.

A plain single-worker executor cannot also poll: the agent runs without nixl's progress
thread (see `nixl_agent`), so someone must call into it periodically to receive notifications,
finish transfers and expire leases. `AgentThread` runs submitted jobs in order and, between
jobs, calls `tick()`, which returns how long to sleep before the next tick. The owner makes
the interval short while work is in flight and long when idle, so an idle engine costs ~no CPU.
A job always gets a tick right after it: the job may have posted a transfer, and waiting out
an idle interval (50 ms) before its first poll would add that much to every transfer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)



class AgentThreadStopped(RuntimeError):
    """A job was submitted to (or left on) a stopped agent thread."""


_Job = tuple[Callable[[], Any], "Future[Any]"]


def _noop() -> None:
    return None


class AgentThread:
    """Runs `submit`ted callables one at a time on one thread, and `tick()` whenever it is due.

    `tick` returns seconds until it wants to run again (0 = as soon as the queue is empty);
    it also runs right after every job.
    A tick that raises is logged and retried after `error_backoff` seconds."""

    def __init__(self, name: str, tick: Callable[[], float], *, error_backoff: float = 0.1) -> None:
        self._tick = tick
        self._backoff = error_backoff
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` for the agent thread; its result (or exception) lands in the Future."""
        fut: Future[T] = Future()
        if self._stopping.is_set():
            fut.set_exception(AgentThreadStopped("agent thread is stopped"))
            return fut
        self._jobs.put((fn, fut))
        return fut

    def wake(self) -> None:
        """Tick soon (from any thread): the owner has new work that wants a shorter interval
        than the one the thread may be sleeping out."""
        if not self._stopping.is_set():
            self._jobs.put((_noop, Future()))

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run `fn` on the agent thread and wait for it (for callers outside the event loop)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Run the jobs already queued, then stop; waits up to `timeout` seconds."""
        self._stopping.set()
        self._jobs.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._thread.is_alive():  # a job that raced past the stop flag gets an error
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    return
                if job is not None and job[1].set_running_or_notify_cancel():
                    job[1].set_exception(AgentThreadStopped("agent thread is stopped"))

    def _run(self) -> None:
        next_tick = time.monotonic()
        while True:
            try:
                job = self._jobs.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                pass  # time to tick
            else:
                if job is None:
                    self._drain()
                    return
                self._run_job(job)
                next_tick = time.monotonic()  # re-evaluate the interval: work may be in flight
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._safe_tick()

    def _run_job(self, job: _Job) -> None:
        fn, fut = job
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # the job's error belongs to its caller
            fut.set_exception(e)

    def _safe_tick(self) -> float:
        try:
            return self._tick()
        except Exception:
            log.exception("agent thread tick failed")
            return self._backoff

    def _drain(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._run_job(job)
