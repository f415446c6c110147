"""A request's priority and the client key it came with.

Priority has vLLM's meaning (`priority` in a completion body: an int, lower is served
earlier, default 0). A request asks for one in its body's `priority` field or, for clients
that cannot change the body, in the `X-Request-Priority` header (the body wins when both
are given). Its client key may be mapped to a priority (`client_keys[].priority`): that is
the priority of its requests that ask none, and the earliest any of them may have, so a
client cannot jump the queue by asking: `effective = max(asked, key's priority)`. Requests
without a mapped key (an open router, or a key of `api_key`/`api_keys`) have 0 as that
bound: they may ask to be later, never earlier. An asked value that is not an integer in
`PRIORITY_MIN..PRIORITY_MAX` is a 400 (`param` "priority").

The router orders its admission queue by the effective priority (router/admission.py) and,
where `forward_priority` is on for the request's model, sends it to the engines as
`priority` on both legs; where it is off the field is removed from the legs, since vLLM
refuses a priority other than 0 unless run with `--scheduling-policy priority`.

Which key a request came with is read from its `Authorization` header after the auth
middleware accepted it (router/http/auth.py): only keys the router accepts are ever looked
up, so the plain dict lookup tells nothing a client did not already prove. Keys are never
logged: logs, metrics and the fair queue know a key by its configured `name`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import Scope

from pdgate.common.bearer import bearer_credential
from pdgate.router.config import RouterConfig
from pdgate.router.errors import InvalidRequest

__all__ = ["PRIORITY_HEADER", "PRIORITY_MAX", "PRIORITY_MIN", "ClientKeys", "KeySettings",
           "apply_priority", "priority_header", "request_priority"]

PRIORITY_HEADER = "X-Request-Priority"
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # a C int, as engines store it
_HEADER_RAW = PRIORITY_HEADER.lower().encode()
_INT = re.compile(r"[+-]?[0-9]{1,10}")


@dataclass(frozen=True, slots=True)
class KeySettings:
    """What the router knows of one accepted client key: its `name` (never the key), the
    earliest `priority` its requests may have, its `tokens_per_minute` quota (None: none)."""

    name: str
    priority: int = 0
    tokens_per_minute: int | None = None


class ClientKeys:
    """The settings of every client key the router accepts, found from a request's
    `Authorization` header. Keys of `api_key` / `api_keys` get priority 0, no quota and the
    names `api_key` / `api_keys[i]` (each its own flow in the fair queue)."""

    def __init__(self, config: RouterConfig) -> None:
        found: dict[bytes, KeySettings] = {}
        if config.api_key:
            found[config.api_key.encode()] = KeySettings("api_key")
        for i, key in enumerate(config.api_keys):
            found.setdefault(key.encode(), KeySettings(f"api_keys[{i}]"))
        for entry in config.client_keys:
            found[entry.key.encode()] = KeySettings(
                entry.name, entry.priority, entry.tokens_per_minute)
        self._by_key = found

    def of(self, scope: Scope) -> KeySettings | None:
        """The settings of the key the request carries (None: no key, or the router is
        open and this key is not one of its own)."""
        if not self._by_key:
            return None
        for name, value in scope["headers"]:
            if name == b"authorization":
                credential = bearer_credential(bytes(value))
                return None if credential is None else self._by_key.get(credential)
        return None


def request_priority(body: Mapping[str, Any], header: str | None,
                     key: KeySettings | None) -> int:
    """The request's effective priority: what it asks (body `priority`, else the
    `X-Request-Priority` header value `header`), bounded below by its key's priority (0
    without a mapped key). Raises `InvalidRequest` for a value that is not an integer in
    range."""
    floor = key.priority if key is not None else 0
    asked: int | None = None
    if "priority" in body:
        value = body["priority"]
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRequest("priority must be an integer (lower is served earlier)",
                                 param="priority")
        asked = value
    elif header is not None:
        if not _INT.fullmatch(header.strip()):
            raise InvalidRequest(f"{PRIORITY_HEADER} must be an integer (lower is served "
                                 "earlier)", param="priority")
        asked = int(header)
    if asked is not None and not PRIORITY_MIN <= asked <= PRIORITY_MAX:
        raise InvalidRequest(f"priority must be in {PRIORITY_MIN}..{PRIORITY_MAX}",
                             param="priority")
    return floor if asked is None else max(asked, floor)


def priority_header(scope: Scope) -> str | None:
    """The request's `X-Request-Priority` header value (None: absent)."""
    for name, value in scope["headers"]:
        if name == _HEADER_RAW:
            return bytes(value).decode("latin-1")
    return None


def apply_priority(body: dict[str, Any], priority: int, forward: bool) -> None:
    """Set the legs' `priority` (both legs copy the client's body: router/flows/bodies.py):
    the effective priority when `forward`, else none (engines without priority
    scheduling refuse any other than 0)."""
    if forward:
        body["priority"] = priority
    else:
        body.pop("priority", None)
