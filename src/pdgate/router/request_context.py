"""What the router knows about the request being served, for its log lines and access line.

The access-log middleware (router/http/access_log.py) opens one `RequestRecord` per HTTP request
and makes it current for everything that runs on the request's behalf, including tasks it
spawns (a `ContextVar` is copied into them). Code deeper down fills in what it learns: the
API handler the request ids, metrics helpers the mode, TTFT and token counts. Log lines
read the ids from here (router/logs.py), so no call site passes them around.

A `ContextVar` is request-scoped, not a process singleton: each request sees its own record
and nothing outlives it.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["RequestRecord", "RequestWatcher", "bind_ids", "close_record", "current", "open_record"]


class RequestWatcher(Protocol):
    """Told what a request measured as it happens (the measured-cost decider learns from
    it: router/policies/measured_cost.py). Called on the event loop; must not block."""

    def preferred(self, role: str) -> str | None:
        """The engine key the `role` leg should go to when it is eligible (the one the
        decider predicted its prompt on); None: the leg's policy picks."""

    def sent(self, role: str, key: str) -> None:
        """A `role` leg of the request was given to the engine `key` (chosen, about to be
        sent): that engine's queue holds it from now on."""

    def prefill_done(self, seconds: float) -> None:
        """The request's P leg answered after `seconds`."""

    def first_token(self, ttft: float) -> None:
        """Its first token reached the router `ttft` seconds after its arrival."""

    def ended(self) -> None:
        """The request is over, however it ended (called once)."""


@dataclass(slots=True)
class RequestRecord:
    """One request as the access line reports it. Times are `time.perf_counter()` seconds;
    fields stay None until someone learns them."""

    method: str
    path: str
    arrival: float = field(default_factory=time.perf_counter)
    request_id: str | None = None  # the router's internal id (what engines log)
    client_request_id: str | None = None  # the client's X-Request-Id, sanitised
    model: str | None = None
    mode: str | None = None
    fallback: str | None = None
    ttft_s: float | None = None
    prefill_s: float | None = None  # its P leg's round trip
    admission_wait_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    engines: dict[str, str] = field(default_factory=dict)  # role -> engine URL
    migrations: int | None = None  # continuations of a stream whose decode engine failed
    decision: str | None = None  # the decider's reason (measured-cost decider)
    predicted_ttft_s: float | None = None  # its predicted time to first token
    priority: int | None = None  # its effective priority (router/priority.py)
    client_key: str | None = None  # the name of its client key (never the key)
    watcher: RequestWatcher | None = None


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "pdgate_request", default=None
)


def current() -> RequestRecord | None:
    """The record of the request this code runs for, or None outside a request."""
    return _current.get()


def open_record(record: RequestRecord) -> contextvars.Token[RequestRecord | None]:
    """Make `record` current; pass the token to `close_record` when the request is over."""
    return _current.set(record)


def close_record(token: contextvars.Token[RequestRecord | None]) -> None:
    """Undo `open_record`."""
    _current.reset(token)


def bind_ids(internal: str, client: str | None) -> None:
    """Note the request's ids (called by the API handler once it made them); a no-op
    outside a request."""
    record = _current.get()
    if record is not None:
        record.request_id, record.client_request_id = internal, client
