"""The KV-ready wire contract: pure data (msgspec + stdlib), no zmq import.

A notification travels as one zmq multipart message: ``[payload]``, or ``[payload, mac]``
when a shared secret is configured, where ``mac = HMAC-SHA256(secret, payload)``.
``payload`` is a msgpack (or JSON) map holding a tagged struct: ``kind`` names the struct and
``v`` the protocol version. Receivers decode in two phases: first the envelope (``v``,
``kind``), then the payload for that kind, so an unknown version or kind is reported as such
instead of as a generic decode error.

Compatibility: a map without ``v`` but with a string ``req_id`` field is LMCache's proxy
notification (``ProxyNotif`` / ``NixlMsg``, msgpack or JSON); it decodes to ``KVReady`` with
status ``ok``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

# Protocol version history (bump on any change a receiver of the old version would misread):
#   1: KVReady{v, request_id, engine_id, num_tokens, num_blocks, status, error, ts} and
#      Heartbeat{v, engine_id, ts}; optional HMAC-SHA256 trailer frame.
PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

MAC_SIZE = hashlib.sha256().digest_size

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class _Message(msgspec.Struct, tag_field="kind", frozen=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class KVReady(_Message, tag="kv_ready", frozen=True):
    """The KV of `request_id` is in place on the decode side (status ok) or never will be.

    Sent by the prefill engine (after its NIXL WRITE completes, or fails) to the router proxy
    whose address came in the request's kv_transfer_params. `ts` is the sender's wall clock
    (seconds since the epoch), for logs only: receivers never compare clocks with it.
    """

    request_id: RequestId
    engine_id: str = ""
    num_tokens: Count = 0
    num_blocks: Count = 0
    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    ts: float = msgspec.field(default_factory=time.time)


class Heartbeat(_Message, tag="heartbeat", frozen=True):
    """Liveness ping from an engine; counted and otherwise ignored."""

    engine_id: str = ""
    ts: float = msgspec.field(default_factory=time.time)


Message = KVReady | Heartbeat

# Metric label values for the kind of a frame: the struct tags, plus LMCache compatibility
# messages and frames whose kind could not be determined.
KIND_LMCACHE = "lmcache"
KIND_UNKNOWN = "unknown"


class WireError(ValueError):
    """A frame that must be dropped; `reason` is a metric label value.

    reasons: ``malformed`` (not a valid message), ``bad_version`` (version not supported),
    ``unknown_kind`` (valid envelope, kind not known), ``bad_mac`` (MAC missing or wrong).
    """

    def __init__(self, reason: str, detail: str, kind: str = KIND_UNKNOWN) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.kind = kind


class _Envelope(msgspec.Struct):
    # Phase one: only what is needed to pick the payload type; other fields are skipped.
    v: int | None = None
    kind: str | None = None
    req_id: str | None = None


class _LMCacheNotif(msgspec.Struct):
    req_id: RequestId


def sign(payload: bytes, secret: bytes) -> bytes:
    """HMAC-SHA256 of `payload` under `secret` (the trailer frame)."""
    return hmac.digest(secret, payload, "sha256")


def encode(msg: Message) -> bytes:
    """msgpack payload of one message."""
    return msgspec.msgpack.encode(msg)


def to_frames(msg: Message, secret: bytes | None = None) -> list[bytes]:
    """The multipart frames to send for `msg`: ``[payload]`` or ``[payload, mac]``."""
    payload = encode(msg)
    return [payload] if secret is None else [payload, sign(payload, secret)]


class FrameDecoder:
    """Turns received multipart frames into messages; stateless after construction.

    With a secret, frames must be ``[payload, mac]`` with a valid MAC. Without one, a trailer
    frame is ignored (the receiver trusts the network). Built once per receiver and reused.
    """

    def __init__(self, secret: bytes | None = None) -> None:
        # A keyed HMAC state copied per frame skips re-deriving the key pads (~30% faster).
        self._mac = None if secret is None else hmac.new(secret, digestmod=hashlib.sha256)
        self._env = (msgspec.msgpack.Decoder(_Envelope), msgspec.json.Decoder(_Envelope))
        self._lmc = (msgspec.msgpack.Decoder(_LMCacheNotif), msgspec.json.Decoder(_LMCacheNotif))
        self._by_kind: dict[str, tuple[msgspec.msgpack.Decoder[Message],
                                       msgspec.json.Decoder[Message]]] = {
            str(t.__struct_config__.tag): (msgspec.msgpack.Decoder(t), msgspec.json.Decoder(t))
            for t in (KVReady, Heartbeat)
        }

    def decode(self, frames: Sequence[bytes]) -> tuple[str, Message]:
        """Return ``(kind label, message)``; raise `WireError` for anything to drop."""
        payload = self._authenticate(frames)
        fmt = 1 if payload[:1] == b"{" else 0  # JSON objects start with '{'; msgpack maps never
        try:
            env = self._env[fmt].decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("malformed", str(exc)) from None
        if env.v is None:
            return self._decode_lmcache(env, payload, fmt)
        if env.v not in SUPPORTED_VERSIONS:
            raise WireError("bad_version", f"version {env.v}", env.kind or KIND_UNKNOWN)
        decoders = self._by_kind.get(env.kind or "")
        if decoders is None:
            raise WireError("unknown_kind", f"kind {env.kind!r}")
        try:
            return env.kind or "", decoders[fmt].decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("malformed", str(exc), env.kind or KIND_UNKNOWN) from None

    def _authenticate(self, frames: Sequence[bytes]) -> bytes:
        if not frames or len(frames) > 2:
            raise WireError("malformed", f"{len(frames)} frames")
        if self._mac is None:
            return frames[0]
        if len(frames) != 2:
            raise WireError("bad_mac", "missing MAC")
        mac = self._mac.copy()
        mac.update(frames[0])
        if not hmac.compare_digest(frames[1], mac.digest()):
            raise WireError("bad_mac", "wrong MAC")
        return frames[0]

    def _decode_lmcache(self, env: _Envelope, payload: bytes, fmt: int) -> tuple[str, Message]:
        if env.req_id is None:
            raise WireError("malformed", "no version and no req_id")
        try:
            notif = self._lmc[fmt].decode(payload)
        except msgspec.ValidationError as exc:
            raise WireError("malformed", str(exc), KIND_LMCACHE) from None
        return KIND_LMCACHE, KVReady(request_id=notif.req_id, engine_id=KIND_LMCACHE)
