"""Request identities: the router's own id for engines, the client's id for humans.

Every request gets a fresh internal id (`new_internal_id`) that keys everything between the
router and the engines: P's lease, D's reservation, push registrations and landings,
KV-ready waiters and NIXL notices. Clients reuse `X-Request-Id` values (idempotency keys on
retries, shared trace ids), so keying engine state by the client's id would let two
requests share, or steal, each other's KV. The client's id only ever appears in logs,
traces and the response's `X-Request-Id` header, after `client_request_id` bounded and
sanitised it (header values arrive latin-1 decoded; anything outside printable ASCII is
dropped rather than re-encoded).
"""

from __future__ import annotations

import os
import re

__all__ = ["MAX_CLIENT_ID_CHARS", "InternalIds", "client_request_id", "new_internal_id"]

MAX_CLIENT_ID_CHARS = 128
_UNPRINTABLE = re.compile(r"[^\x21-\x7e]+")


def new_internal_id() -> str:
    """A fresh id no client can choose or predict (32 hex digits)."""
    return os.urandom(16).hex()  # what uuid4 draws, without building a UUID


class InternalIds:
    """`new_internal_id`'s ids, drawn from one `os.urandom` read per `batch` ids (a
    getrandom syscall per request showed in the router's profile). The bytes are the
    kernel's CSPRNG output, each used once and never shown before, so the ids are as
    unpredictable. One per serving process (router workers are separate processes, never
    forks of one that drew ids). Event loop only."""

    __slots__ = ("_pool", "_at", "_batch")

    def __init__(self, batch: int = 256) -> None:
        self._pool = b""
        self._at = 0
        self._batch = batch

    def new(self) -> str:
        """A fresh id (32 hex digits)."""
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(16 * self._batch), 0
        self._at = at + 16
        return self._pool[at:at + 16].hex()


def client_request_id(header: str | None) -> str | None:
    """The client's `X-Request-Id` made safe to log and echo: printable ASCII without
    spaces, at most `MAX_CLIENT_ID_CHARS` characters; None when nothing usable is left."""
    if not header:
        return None
    cleaned = _UNPRINTABLE.sub("", header[: MAX_CLIENT_ID_CHARS * 4])
    return cleaned[:MAX_CLIENT_ID_CHARS] or None
