"""Errors of the KV transfer path (connector, side channel, NIXL adapter).

    KVConnectorError            anything the connector reports to the engine
     ├── NixlAgentError         a NIXL call failed (or nixl is not installed)
     └── KVTransferError        a pull could not deliver the remote blocks
          └── KVHandshakeError  the side-channel handshake failed or the peer is incompatible

`KVConnector.pull` raises only `KVTransferError` (and its subclass), so the engine can fall
back to recomputing the prompt on exactly one exception type.
"""

from __future__ import annotations


class KVConnectorError(Exception):
    """Base of every error the KV connector raises."""


class NixlAgentError(KVConnectorError):
    """A NIXL agent call failed; the message names the call."""


class KVTransferError(KVConnectorError):
    """A KV pull failed: bad params, handshake, transfer error or deadline passed.
    `reason` labels the failure metric: "params", "transfer", "timeout" or "handshake"."""

    default_reason = "transfer"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or self.default_reason


class KVHandshakeError(KVTransferError):
    """The side-channel handshake failed (no reply in time, bad frame) or the peer is
    incompatible (protocol version, model, KV layout, engine id)."""

    default_reason = "handshake"
