"""The drain before a shutdown: on SIGTERM the router first stops looking ready, then stops.

A load balancer that health-checks the router itself (an ingress controller or cloud load
balancer probing `/ready`, a proxy outside Kubernetes) keeps sending it new requests until
that check fails; Kubernetes' own endpoint update after a pod deletion reaches every proxy
only after a while too. So on SIGTERM, with `drain_delay_s` > 0, the router:

1. answers `/ready` with 503 `{"status": "draining", ...}` at once (`/health` stays 200:
   the process is alive, a liveness probe must not restart it);
2. keeps serving everything else, in-flight and new requests alike, for `drain_delay_s`,
   with `Connection: close` on every response so keep-alive clients reconnect elsewhere;
3. then runs the graceful shutdown it always had: stop accepting, let in-flight requests
   finish within `shutdown_timeout_s`, exit 0.

SIGINT, or a second signal during the drain, skips what is left of the delay and starts
the graceful shutdown at once. No HTTP endpoint starts a drain: only a signal does, which
only the process's own user (or Kubernetes, or whoever can exec into the pod) can send, so
there is no control route to protect. The chart sets `drain_delay_s` from
`router.drainDelaySeconds` and no preStop hook (Kubernetes sends SIGTERM at deletion).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

__all__ = ["Drain", "DrainingServer", "EarlySignals"]

log = logging.getLogger(__name__)
_CLOSE = (b"connection", b"close")


class Drain:
    """Whether this router process is draining. Set from the signal handler of
    `DrainingServer`; read by `/ready` (router/http/api.py)."""

    def __init__(self) -> None:
        self._until: float | None = None  # time.monotonic() when the drain ends

    @property
    def active(self) -> bool:
        return self._until is not None

    def start(self, delay_s: float) -> None:
        self._until = time.monotonic() + delay_s

    def remaining_s(self) -> float:
        """Seconds left before the graceful shutdown starts (0 when not draining)."""
        return 0.0 if self._until is None else max(0.0, self._until - time.monotonic())

    def over(self) -> bool:
        return self._until is not None and time.monotonic() >= self._until

    def status(self) -> dict[str, Any]:
        """What `/ready` answers (with a 503) while draining."""
        left = round(self.remaining_s(), 1)
        return {"status": "draining", "drain_remaining_s": left,
                "reason": f"shutting down (SIGTERM): requests are still served for {left} s, "
                          "then in-flight ones finish"}


class EarlySignals:
    """SIGINT/SIGTERM that reach the process before uvicorn installs its handlers, kept for
    `DrainingServer` to act on once it has. Without it a `--workers` worker that Kubernetes
    (or its parent) stopped while it was still starting lost the signal: it came up, served
    and never drained, and its parent killed it after drain + shutdown + 5 s. Also where the
    signal lands after uvicorn restores this handler and re-raises what it caught, so a
    requested shutdown exits 0 instead of dying by that signal."""

    def __init__(self) -> None:
        self._seen: list[int] = []

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._note)

    def _note(self, sig: int, _frame: FrameType | None) -> None:
        self._seen.append(sig)

    def take(self) -> list[int]:
        """The signals seen so far, oldest first; forgotten here."""
        seen, self._seen = self._seen, []
        return seen


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain of this module in front of its graceful shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain, delay_s: float,
                 early: EarlySignals) -> None:
        super().__init__(config)
        self._drain = drain
        self._delay_s = delay_s
        self._early = early
        self._announced = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            for sig in self._early.take():  # arrived while the process was starting
                self.handle_exit(sig, None)
            yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a Python signal handler in the loop's thread: only flags are set here;
        # `on_tick` (every 0.1 s) logs and acts on them.
        if (sig == signal.SIGTERM and self._delay_s > 0 and not self._drain.active
                and not self.should_exit):
            self._drain.start(self._delay_s)
            self._close_connections()
            return
        super().handle_exit(sig, frame)

    def _close_connections(self) -> None:
        """Every response from now on closes its connection: clients with keep-alive pools
        open their next connection through the Service, to another replica."""
        state = self.server_state
        if _CLOSE not in state.default_headers:
            state.default_headers = [*state.default_headers, _CLOSE]

    async def on_tick(self, counter: int) -> bool:
        if self._drain.active and not self._announced:
            self._announced = True
            log.info("SIGTERM: draining for %.1f s (/ready answers 503, requests are still "
                     "served), then shutting down", self._delay_s)
        if self._drain.over() and not self.should_exit:
            log.info("drain over: shutting down")
            self.should_exit = True
        done = await super().on_tick(counter)  # refreshes default_headers once a second
        if self._drain.active:
            self._close_connections()
        return done
