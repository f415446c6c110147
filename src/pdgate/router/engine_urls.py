"""Whether a string is a usable engine base URL (static config, the admin API, discovery)."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

__all__ = ["engine_url_problem"]


def engine_url_problem(url: str) -> str | None:
    """Why `url` is not a usable engine base URL, or None when it is: http(s) only, a host,
    a valid port, no credentials (they would reach logs and metric labels), no path, query
    or fragment. Used for static URLs here and by the admin API."""
    if not url.strip().isascii() or not url.strip().isprintable() or " " in url.strip():
        return "engine URL must be printable ASCII without spaces"
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 -- raises ValueError when out of range or not a number
    except ValueError:
        return "invalid engine URL (bad port?)"
    if parts.scheme not in ("http", "https"):
        return "engine URL must start with http:// or https://"
    if not parts.hostname:
        return "engine URL needs a host"
    if not _valid_host(parts.hostname):
        return f"engine URL host {parts.hostname!r} is not a DNS name or IP address"
    if parts.username is not None or parts.password is not None:
        return "engine URL must not carry credentials"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "engine URL is a base URL: no path, query or fragment"
    return None


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _valid_host(host: str) -> bool:
    # urlsplit accepts spaces and control characters in the host; the engine client would
    # then fail every request to it, so such an engine must never enter the pool.
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels)
