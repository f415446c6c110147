"""The one bearer-key check of every pdgate HTTP edge (the router's and the shim's).

A credential is read from an `Authorization` header value: `Bearer <key>` (scheme
case-insensitive, surrounding blanks ignored) or, where a caller allows it, HTTP Basic with
the key as password (any user name; browsers send this for the router's dashboard). Keys are
compared in constant time (`hmac.compare_digest`), every key checked with no early exit, so
the time taken does not tell which key was close. Nothing here logs a key.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Sequence

__all__ = ["any_key_matches", "bearer_credential", "bearer_matches"]


def bearer_matches(authorization: bytes | None, key: bytes) -> bool:
    """True when an `Authorization` header value is `Bearer <key>`."""
    return any_key_matches(authorization, (key,))


def any_key_matches(
    authorization: bytes | None, keys: Sequence[bytes], *, basic: bool = False
) -> bool:
    """True when `authorization` carries one of `keys`: `Bearer <key>`, or with `basic`
    also HTTP Basic with the key as password."""
    token = _credential(authorization, basic)
    if token is None:
        return False
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


def bearer_credential(authorization: bytes | None) -> bytes | None:
    """The key an `Authorization: Bearer <key>` header value carries (None: no Bearer
    credential). Compares nothing: for finding the settings of a key already accepted."""
    return _credential(authorization, False)


def _credential(authorization: bytes | None, basic: bool) -> bytes | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    scheme = scheme.lower()
    if scheme == b"bearer":
        return token.strip()
    if basic and scheme == b"basic":
        try:
            decoded = base64.b64decode(token.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        return decoded.partition(b":")[2]
    return None
