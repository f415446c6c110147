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

__all__ = ["MAX_CLIENT_ID_CHARS", "client_request_id", "new_internal_id"]

MAX_CLIENT_ID_CHARS = 128
_UNPRINTABLE = re.compile(r"[^\x21-\x7e]+")


def new_internal_id() -> str:
    """A fresh id no client can choose or predict (32 hex digits)."""
    return os.urandom(16).hex()  # what uuid4 draws, without building a UUID


def client_request_id(header: str | None) -> str | None:
    """The client's `X-Request-Id` made safe to log and echo: printable ASCII without
    spaces, at most `MAX_CLIENT_ID_CHARS` characters; None when nothing usable is left."""
    if not header:
        return None
    cleaned = _UNPRINTABLE.sub("", header[: MAX_CLIENT_ID_CHARS * 4])
    return cleaned[:MAX_CLIENT_ID_CHARS] or None
