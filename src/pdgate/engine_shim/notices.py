"""NIXL notifications between shims: one typed, versioned encoding for every kind.

Pure data (no NIXL, no zmq). Every notification a shim sends or receives over NIXL is one
msgpack frame `Envelope{v, notice}` whose `notice` is a tagged struct (`kind`):

    kind     direction  when                                   carries
    done     D -> P     pull: D's READ finished (rides on it)  lease id (P's remote_request_id)
    reg      D -> P     push: write the prompt into my blocks  `Registration`
    unreg    D -> P     push: D gave up; never write for it    request id
    landed   P -> D     notify/push: P's WRITE landed          tag, P's sampled token(s)
    failed   P -> D     notify/push: that WRITE will not land  tag, reason word, detail

Ids are string fields, never prefixes or separators in a text line, so a request id may hold
anything (`pdgate:...`, `:`, newlines, non-ASCII) without one kind being read as another.

Decoding is two-phase, as `side_channel`: the envelope first (size bound, version check; the
notice is kept raw), then the notice (strict). Every failure, including a nesting bomb's
RecursionError, is a `NoticeError` whose `reason` is a metric label value, so a receiver can
count it and go on with the next notification.

Version history (NOTICE_VERSION):
  1: typed notices replace the text formats `pdgate:reg:<msgpack>`, `pdgate:unreg:<id>`,
     `pdgate:landed:<tag>[\\n<ids>]` and vLLM's `<remote_request_id>:<tp_size>` "done" text
     (SIDE_CHANNEL_VERSION 2 advertises it: peers of another format refuse to pair).
  2: `failed{tag, reason, detail}` (P -> D): P will not WRITE (or its WRITE failed) for a
     landing D waits for, so D fails or recomputes at once instead of at its timeout. A v1
     peer would drop it as malformed and stall, so SIDE_CHANNEL_VERSION 3 advertises it.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec

__all__ = [
    "FAILURE_REASONS",
    "MAX_NOTICE_BYTES",
    "NOTICE_VERSION",
    "Failed",
    "Landed",
    "Notice",
    "NoticeError",
    "ReadDone",
    "Registration",
    "Unregistration",
    "decode_notice",
    "encode_notice",
    "failed",
]

NOTICE_VERSION = 2
# Bound on one frame, checked before any decoding. A registration names one block id per
# prompt block (<= 5 msgpack bytes each): 1 MiB fits ~200k blocks, far above a real prompt.
MAX_NOTICE_BYTES = 1 << 20
T = TypeVar("T")
_MAX_FIRST_TOKENS = 1024  # P samples one token; a few more leave room for speculative runs
# `Failed.reason` words a sender uses today. A receiver accepts any short word (a newer
# sender may add one) and labels metrics with "other" for words it does not know.
FAILURE_REASONS = frozenset({
    "transfer",   # the WRITE (or its preparation) failed
    "timeout",    # the WRITE timed out, or its deadline passed before it could start
    "params",     # D's blocks cannot hold P's prompt (sizes differ, ids out of range)
    "handshake",  # P could not reach D's side channel
    "aborted",    # the router aborted the request on P (POST /v1/kv/abort)
    "prefill",    # P's prefill failed, was cancelled or stopped before handing its KV over
    "expired",    # P's prompt or D's registration outlived P's TTL (--kv-lease-seconds)
    "duplicate",  # another D registered for this request id first
    "full",       # P holds too many registrations already
    "shutdown",   # P is shutting down
})
_MAX_REASON_CHARS = 32
_MAX_DETAIL_CHARS = 512

BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Port = Annotated[int, msgspec.Meta(gt=0, lt=65536)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class _Notice(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    """Base of every notice kind (the `kind` tag tells them apart)."""


class ReadDone(_Notice, tag="done", frozen=True):
    """D -> P (pull): D finished READing the blocks leased as `lease_id`; free them."""

    lease_id: str


class Registration(_Notice, tag="reg", frozen=True):
    """D -> P (push): write request `request_id`'s prompt KV into my `block_ids`."""

    request_id: str
    engine_id: str
    host: str
    port: Port
    agent_name: str
    block_ids: list[BlockId]
    num_tokens: Count


class Unregistration(_Notice, tag="unreg", frozen=True):
    """D -> P (push): D stopped waiting for `request_id`; never write for it."""

    request_id: str


class Landed(_Notice, tag="landed", frozen=True):
    """P -> D (notify/push): the WRITE tagged `tag` landed (NIXL delivers this after the
    data). `first_token_ids`: the token(s) P sampled, for a D that continues after them."""

    tag: str
    first_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=_MAX_FIRST_TOKENS)] = []


class Failed(_Notice, tag="failed", frozen=True):
    """P -> D (notify/push): the WRITE tagged `tag` will not land (P gave up, aborted, or
    the WRITE failed); D stops waiting at once. `reason`: one word (FAILURE_REASONS), a
    metric label; `detail`: free text for D's log."""

    tag: str
    reason: Annotated[str, msgspec.Meta(max_length=_MAX_REASON_CHARS)]
    detail: Annotated[str, msgspec.Meta(max_length=_MAX_DETAIL_CHARS)] = ""


Notice = ReadDone | Registration | Unregistration | Landed | Failed


def failed(tag: str, reason: str, detail: str = "") -> Failed:
    """A `Failed` whose reason and detail fit the receiver's bounds (cut, never refused)."""
    return Failed(tag=tag, reason=reason[:_MAX_REASON_CHARS],
                  detail=detail[:_MAX_DETAIL_CHARS])


class Envelope(msgspec.Struct, frozen=True):
    """Outer frame: decoded first (lenient), so a newer peer gets a clear version error."""

    v: int
    notice: msgspec.Raw = msgspec.Raw(b"")


class NoticeError(ValueError):
    """A notification that must be dropped. `reason` (a metric label value): `oversized`
    (over MAX_NOTICE_BYTES), `malformed` (not a valid frame or notice, including nesting
    too deep to decode), `bad_version` (another NOTICE_VERSION)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_NOTICE: msgspec.msgpack.Decoder[Notice] = msgspec.msgpack.Decoder(Notice)


def encode_notice(notice: Notice) -> bytes:
    """One frame for `notice`. Raises NoticeError("oversized") when the receiver would drop
    it (an id near MAX_NOTICE_BYTES), so the sender fails loudly instead."""
    frame = _ENCODER.encode(Envelope(v=NOTICE_VERSION,
                                     notice=msgspec.Raw(_ENCODER.encode(notice))))
    if len(frame) > MAX_NOTICE_BYTES:
        raise NoticeError("oversized", f"{len(frame)}-byte notice over {MAX_NOTICE_BYTES}")
    return frame


def decode_notice(frame: bytes) -> Notice:
    """The notice in `frame`; raises NoticeError (only) on anything else."""
    if len(frame) > MAX_NOTICE_BYTES:
        raise NoticeError("oversized", f"{len(frame)}-byte frame over {MAX_NOTICE_BYTES}")
    env = _decode(_ENVELOPE, frame, "envelope")
    if env.v != NOTICE_VERSION:
        raise NoticeError("bad_version", f"notice version {env.v}, expected {NOTICE_VERSION}")
    return _decode(_NOTICE, bytes(env.notice), "notice")


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str) -> T:
    try:
        return decoder.decode(data)
    # RecursionError: msgspec's answer to deep nesting, even inside fields it skips.
    except (msgspec.DecodeError, RecursionError, ValueError) as e:
        raise NoticeError("malformed", f"bad {what}: {e}") from e
