"""Worker processes for client-supplied chat templates.

`TemplateWorkers`: client-supplied templates render in worker processes under a memory
rlimit and are killed past their deadline, so a bomb the sandbox's hooks
(router/input/template_sandbox.py) miss still cannot take the router's memory or event
loop (router/input/tokenization.py decides who renders where).
"""

from __future__ import annotations

import os
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from pdgate.router.errors import InvalidRequest, Overloaded
from pdgate.router.input.limits import MIB, InputLimits
from pdgate.router.input.template_sandbox import BoundedEnvironment, render_bounded

__all__ = ["TemplateWorkers", "worker_count", "worker_main"]

_READY = b"R"
_FRAME = struct.Struct(">I")
_STARTUP_TIMEOUT_S = 30.0
_KILL_GRACE_S = 0.5  # a worker normally stops itself at its deadline; past this, kill it
_RECYCLE_RSS_BYTES = 256 * MIB  # a worker that grew this much is replaced


class _Request(msgspec.Struct, frozen=True):
    source: str
    variables: dict[str, Any]
    timeout_s: float
    max_chars: int
    stop_after: int | None


class _Reply(msgspec.Struct, frozen=True):
    text: str | None = None
    error: str | None = None
    rss: int = 0


class _Worker:
    def __init__(self, memory_bytes: int) -> None:
        code = "from pdgate.router.input.template_workers import worker_main; worker_main()"
        # Own session: a terminal's Ctrl-C goes to the router, which then closes stdin.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(memory_bytes)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, start_new_session=True)
        self.ready = False

    def exchange(self, frame: bytes, wait_s: float, limit: int) -> bytes:
        """Send one request frame and read the reply within `wait_s`; raise TimeoutError,
        EOFError or OSError."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        out = self.proc.stdout.fileno()
        if not self.ready:  # interpreter start and imports are not the template's time
            _read_exact(out, 1, time.monotonic() + _STARTUP_TIMEOUT_S)
            self.ready = True
        deadline = time.monotonic() + wait_s
        self.proc.stdin.write(frame)
        self.proc.stdin.flush()
        (size,) = _FRAME.unpack(_read_exact(out, _FRAME.size, deadline))
        if size > limit:
            raise EOFError(f"reply of {size} bytes")
        return _read_exact(out, size, deadline)

    def close(self) -> None:
        self.proc.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass  # a broken pipe to a worker we are ending anyway
        self.proc.wait()


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    parts: list[bytes] = []
    while n > 0:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError
        chunk = os.read(fd, min(n, MIB))
        if not chunk:
            raise EOFError("worker exited")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


class TemplateWorkers:
    """Renders client-supplied chat templates in up to `size` worker processes.

    Each worker (`python -c worker_main`) runs one render at a time under an address-space
    rlimit, with the same `BoundedEnvironment`; one that misses its deadline (plus a short
    grace) or dies is killed and replaced on next use. Workers start on first use; call
    `aclose()` when done. Methods are called on the event loop.
    """

    def __init__(self, limits: InputLimits, size: int = 2) -> None:
        self._limits = limits
        self._memory_bytes = 256 * MIB + 8 * limits.chat_template_max_output_chars
        self._reply_limit = 8 * limits.chat_template_max_output_chars + 4096
        # Admission on the event loop: requests queued for a worker hold no thread.
        self._slots = anyio.CapacityLimiter(size)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._closed = False

    async def render(self, source: str, variables: dict[str, Any], *,
                     stop_after: int | None = None) -> str:
        """Render like `render_bounded`, in a worker. Raises `InvalidRequest` (the template
        failed or ran out of budget) or `Overloaded` (every worker stayed busy for a whole
        timeout)."""
        timeout = self._limits.chat_template_timeout_s
        request = _Request(source, variables, timeout,
                           self._limits.chat_template_max_output_chars, stop_after)
        try:
            with anyio.fail_after(timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise Overloaded("too many client chat templates are rendering; retry "
                             "later") from None
        try:
            reply = await anyio.to_thread.run_sync(self._render_blocking, request, timeout)
        finally:
            self._slots.release()
        if reply.error is not None:
            raise InvalidRequest(reply.error, param="chat_template")
        return reply.text or ""

    def _render_blocking(self, request: _Request, timeout: float) -> _Reply:
        frame = msgspec.json.encode(request)  # megabytes of messages: not on the loop
        worker = self._checkout()
        try:
            raw = worker.exchange(_FRAME.pack(len(frame)) + frame, timeout + _KILL_GRACE_S,
                                  self._reply_limit)
            reply = msgspec.json.decode(raw, type=_Reply)
        except TimeoutError:
            self._discard(worker)
            raise InvalidRequest(f"chat template took longer than {timeout:g} s",
                                 param="chat_template") from None
        except (EOFError, OSError, msgspec.DecodeError):
            self._discard(worker)
            raise InvalidRequest("chat template render failed: its worker process died "
                                 "(out of memory?)", param="chat_template") from None
        if reply.rss > _RECYCLE_RSS_BYTES:
            self._discard(worker)
        else:
            self._checkin(worker)
        return reply

    def _checkout(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise Overloaded("the router is shutting down")
            if self._idle:
                return self._idle.pop()
            worker = _Worker(self._memory_bytes)
            self._all.add(worker)
            return worker

    def _checkin(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        self._discard(worker)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.close()

    async def aclose(self) -> None:
        """Stop every worker (a busy one is killed; its render answers 400)."""
        with self._lock:
            self._closed = True
            workers, self._idle = list(self._all), []
            self._all.clear()
        for worker in workers:
            await anyio.to_thread.run_sync(worker.close)


def worker_count() -> int:
    """Default number of template workers: half the CPUs, 1 to 4."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def worker_main() -> None:
    """Entry point of a template worker: frames on stdin, replies on stdout, until EOF."""
    _limit_memory(int(sys.argv[1]))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write between our frames
    env = BoundedEnvironment()
    stdout.write(_READY)
    stdout.flush()
    while header := stdin.read(_FRAME.size):
        (size,) = _FRAME.unpack(header)
        reply = _serve(env, stdin.read(size))
        stdout.write(_FRAME.pack(len(reply)) + reply)
        stdout.flush()


def _serve(env: BoundedEnvironment, frame: bytes) -> bytes:
    try:
        req = msgspec.json.decode(frame, type=_Request)
        text = render_bounded(env, req.source, req.variables, timeout_s=req.timeout_s,
                              max_chars=req.max_chars, stop_after=req.stop_after)
        reply = _Reply(text=text, rss=_statm(1))
    except InvalidRequest as exc:
        reply = _Reply(error=exc.message, rss=_statm(1))
    except MemoryError:
        reply = _Reply(error="chat template ran out of memory", rss=_RECYCLE_RSS_BYTES + 1)
    return msgspec.json.encode(reply)


def _limit_memory(headroom: int) -> None:
    limit = _statm(0) + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _statm(field: int) -> int:
    """Bytes of this process: 0 = address space, 1 = resident."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")
