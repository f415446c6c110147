"""The KV-ready wire contract: pure data (msgspec + stdlib), no zmq import.

A notification travels as one zmq multipart message: ``[payload]``, or ``[payload, mac]``
when a shared secret is configured, where ``mac = HMAC-SHA256(secret, payload)``.
``payload`` is a msgpack (or JSON) map holding a tagged struct: ``kind`` names the struct and
``v`` the protocol version. Receivers decode in two phases: first the envelope (``v``,
``kind``), then the payload for that kind, so an unknown version or kind is reported as such
instead of as a generic decode error.

Everything here is untrusted input until the MAC checked out, and even then it came from a
process that anyone able to send a prefill request can steer. So before any hashing or
parsing the receiver checks the cheap things: one or two frames, a payload of at most
``max_frame_bytes`` and a MAC frame of exactly `MAC_SIZE` bytes. Decoding is bounded too:
msgspec raises RecursionError on deeply nested input, which becomes ``malformed`` here like
every other decode failure. `FrameDecoder.decode` returns a message or raises `WireError`,
nothing else.

A notice is bound to one wait by ``KVReady.token`` (v2): the router puts a fresh random token
in the prefill leg's kv_transfer_params (``notify_token``) and the engine echoes it inside the
signed payload. A valid MAC only proves that *an* engine sent the notice; the token proves
that the engine was asked by the router for this request (see proxy.waiters).

Compatibility: v1 frames decode (their token is ``""``). A map without ``v`` but with a
string ``req_id`` field is LMCache's proxy notification (``ProxyNotif`` / ``NixlMsg``,
msgpack or JSON); it decodes to ``KVReady`` with status ``ok`` and no token, so it can only
wake a waiter registered without a token.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Annotated, Literal, TypeVar

import msgspec

# Protocol version history (bump on any change a receiver of the old version would misread):
#   1: KVReady{v, request_id, engine_id, num_tokens, num_blocks, status, error, ts} and
#      Heartbeat{v, engine_id, ts}; optional HMAC-SHA256 trailer frame.
#   2: KVReady gains `token` (<= MAX_TOKEN_LENGTH chars, default ""): the router's per-request
#      `notify_token`, echoed by the engine. A v1 receiver would accept a v2 notice while
#      ignoring its token, hence the bump. v1 frames still decode, with token "".
PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, 2})

MAC_SIZE = hashlib.sha256().digest_size
# Largest payload frame decoded by default. A KVReady is a few hundred bytes (request id
# <= 1 KiB, token <= 128); the bound caps what one junk frame can cost (HMAC + parse) and hold.
MAX_FRAME_BYTES = 16 << 10
MAX_TOKEN_LENGTH = 128

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Token = Annotated[str, msgspec.Meta(max_length=MAX_TOKEN_LENGTH)]
Count = Annotated[int, msgspec.Meta(ge=0)]

T = TypeVar("T")
_Decoder = msgspec.msgpack.Decoder[T] | msgspec.json.Decoder[T]


class _Message(msgspec.Struct, tag_field="kind", frozen=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class KVReady(_Message, tag="kv_ready", frozen=True):
    """The KV of `request_id` is in place on the decode side (status ok) or never will be.

    Sent by the prefill engine (after its NIXL WRITE completes, or fails) to the router proxy
    whose address came in the request's kv_transfer_params. `ts` is the sender's wall clock
    (seconds since the epoch), for logs only: receivers never compare clocks with it.
    `token` is the ``notify_token`` the router put in the request's kv_transfer_params,
    echoed unchanged (``""`` when there was none); a waiter registered with a token only
    accepts a notice carrying the same one.
    """

    request_id: RequestId
    engine_id: str = ""
    num_tokens: Count = 0
    num_blocks: Count = 0
    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    ts: float = msgspec.field(default_factory=time.time)
    token: Token = ""


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

    reasons: ``malformed`` (not a valid message, wrong frame count, nested too deeply),
    ``too_large`` (payload frame over ``max_frame_bytes``, not even authenticated),
    ``bad_version`` (version not supported), ``unknown_kind`` (valid envelope, kind not
    known), ``bad_mac`` (MAC missing, of the wrong size or wrong).
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
    frame is ignored (the receiver trusts the network). Payloads over `max_frame_bytes` are
    refused before the MAC is computed. Built once per receiver and reused.
    """

    def __init__(self, secret: bytes | None = None, *,
                 max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        # A keyed HMAC state copied per frame skips re-deriving the key pads (~30% faster).
        self._mac = None if secret is None else hmac.new(secret, digestmod=hashlib.sha256)
        self._max_bytes = max_frame_bytes
        self._env = (msgspec.msgpack.Decoder(_Envelope), msgspec.json.Decoder(_Envelope))
        self._lmc = (msgspec.msgpack.Decoder(_LMCacheNotif), msgspec.json.Decoder(_LMCacheNotif))
        self._by_kind: dict[str, tuple[_Decoder[Message], _Decoder[Message]]] = {
            str(t.__struct_config__.tag): (msgspec.msgpack.Decoder(t), msgspec.json.Decoder(t))
            for t in (KVReady, Heartbeat)
        }

    def decode(self, frames: Sequence[bytes]) -> tuple[str, Message]:
        """Return ``(kind label, message)``; raise `WireError` for anything to drop."""
        payload = self._authenticate(frames)
        fmt = 1 if payload[:1] == b"{" else 0  # JSON objects start with '{'; msgpack maps never
        env = _parse(self._env[fmt], payload, KIND_UNKNOWN)
        if env.v is None:
            return self._decode_lmcache(env, payload, fmt)
        if env.v not in SUPPORTED_VERSIONS:
            raise WireError("bad_version", f"version {env.v}", env.kind or KIND_UNKNOWN)
        decoders = self._by_kind.get(env.kind or "")
        if decoders is None:
            raise WireError("unknown_kind", f"kind {env.kind!r}")
        kind = env.kind or ""
        return kind, _parse(decoders[fmt], payload, kind)

    def _authenticate(self, frames: Sequence[bytes]) -> bytes:
        # Cheapest checks first: a junk frame should cost a few length comparisons, not an
        # HMAC over up to max_frame_bytes.
        if not frames or len(frames) > 2:
            raise WireError("malformed", f"{len(frames)} frames")
        payload = frames[0]
        if len(payload) > self._max_bytes:
            raise WireError("too_large", f"{len(payload)} bytes > {self._max_bytes}")
        if self._mac is None:
            return payload
        if len(frames) != 2 or len(frames[1]) != MAC_SIZE:
            raise WireError("bad_mac", "missing MAC" if len(frames) != 2 else "MAC size")
        mac = self._mac.copy()
        mac.update(payload)
        if not hmac.compare_digest(frames[1], mac.digest()):
            raise WireError("bad_mac", "wrong MAC")
        return payload

    def _decode_lmcache(self, env: _Envelope, payload: bytes, fmt: int) -> tuple[str, Message]:
        if env.req_id is None:
            raise WireError("malformed", "no version and no req_id")
        notif = _parse(self._lmc[fmt], payload, KIND_LMCACHE)
        return KIND_LMCACHE, KVReady(request_id=notif.req_id, engine_id=KIND_LMCACHE)


def _parse(decoder: _Decoder[T], payload: bytes, kind: str) -> T:
    # msgspec raises RecursionError (not DecodeError) on deeply nested arrays or maps, even in
    # fields it skips; any of these is the sender's fault, never ours.
    try:
        return decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireError("malformed", str(exc)[:200], kind) from None
