"""pdgate's own `kv_transfer_params` keys, one typed struct per leg: the router writes them
with `to_params()`, the engine shim reads them with the parse functions. Pure data (msgspec +
stdlib), so both sides import it without importing each other.

vLLM's own keys (`do_remote_prefill`, `do_remote_decode`) stay outside these structs: the
router's leg bodies set them, and they pick the leg here (a P leg says `do_remote_decode`,
a D leg `do_remote_prefill`). The `remote_*` keys of vLLM's pull protocol are parsed in
engine_shim/kv_params.py; the notify and push legs reuse four of those names for their own
meaning (the peer's side channel), and those are checked here.

Legs (`pdgate_mode` picks the flow):
    NotifyPrefillParams  P leg, notify: D's reserved blocks and where to send KV-ready.
    NotifyDecodeParams   D leg, notify: the reservation P wrote into.
    PushPrefillParams    P leg, push: hold the prompt's blocks for D's registration.
    PushDecodeParams     D leg, push: register with P's side channel and await the WRITE.
    Continuation         any decode (also one with no transfer): tokens the client already
                         has from P's reply (`first_token_ids`); D continues after them.

A missing `pdgate_kv_version` reads as version 1 (senders older than the key); a version
this module does not know is refused, naming the key, rather than misread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Literal

import msgspec

__all__ = [
    "KV_PARAMS_VERSION",
    "MODE_KEY",
    "MODES",
    "NOTIFY_TOKEN_MAX_CHARS",
    "VERSION_KEY",
    "Continuation",
    "KVParamsError",
    "NotifyDecodeParams",
    "NotifyPrefillParams",
    "PdgateLeg",
    "PushDecodeParams",
    "PushPrefillParams",
    "parse_continuation",
    "parse_notify_decode",
    "parse_notify_prefill",
    "parse_pdgate_params",
    "parse_push_decode",
    "parse_push_prefill",
    "parse_version",
]

# Version history of pdgate's kv_transfer_params keys (bump on any change an engine of the
# previous version would misread; a missing key means 1):
#   1: the keys as first shipped: pdgate_mode, remote_engine_id, remote_host, remote_port,
#      remote_agent_name, remote_block_ids, reservation_id, num_tokens, notify_endpoint,
#      notify_request_id, notify_token, write_deadline, push_deadline,
#      continue_after_prefill, first_token_ids (see the structs below).
KV_PARAMS_VERSION = 1
VERSION_KEY = "pdgate_kv_version"
MODE_KEY = "pdgate_mode"
MODES = ("notify", "push")
# The KV-ready notice carries the token back; its wire limit (proxy.wire.MAX_TOKEN_LENGTH)
# bounds what the router may send. Repeated here to keep this module free of imports.
NOTIFY_TOKEN_MAX_CHARS = 128
_PREFIX = "kv_transfer_params."


class KVParamsError(ValueError):
    """A pdgate key of `kv_transfer_params` is missing, mistyped or out of range. `field`
    is the full name of the first bad key (e.g. "kv_transfer_params.remote_port"), which
    also starts the message."""

    def __init__(self, key: str, problem: str) -> None:
        self.field = _PREFIX + key
        super().__init__(f"{self.field} {problem}")


class _Leg(msgspec.Struct, frozen=True, kw_only=True):
    mode: ClassVar[str]

    def to_params(self) -> dict[str, object]:
        """The pdgate keys of this leg's `kv_transfer_params` (mode and version included,
        None optionals and false flags left out); the router merges them into the leg's
        vLLM keys."""
        out: dict[str, object] = {MODE_KEY: self.mode, VERSION_KEY: KV_PARAMS_VERSION}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and value is not False:
                out[name] = list(value) if isinstance(value, list) else value
        return out


class NotifyPrefillParams(_Leg, frozen=True, kw_only=True):
    """P leg of notify mode: WRITE the prompt's KV into D's reserved blocks, then send a
    KV-ready notice. `remote_*`: D's engine id, side channel (host, port 1..65535), NIXL
    agent and reserved blocks (ints >= 0); `reservation_id`: D's reservation (the landing's
    tag); `num_tokens` >= 0: prompt tokens the router counted. `notify_endpoint`: the
    router's zmq KV-ready address (None: no notice); `notify_request_id`: the id the notice
    names; `notify_token` (<= 128 chars): echoed in the notice. `write_deadline`: wall clock
    (seconds since the epoch) after which P must not start the WRITE."""

    mode: ClassVar[str] = "notify"
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]
    reservation_id: str
    num_tokens: int
    remote_agent_name: str | None = None
    notify_endpoint: str | None = None
    notify_request_id: str | None = None
    notify_token: str | None = None
    write_deadline: float | None = None


class NotifyDecodeParams(_Leg, frozen=True, kw_only=True):
    """D leg of notify mode: the prompt's KV is in reservation `reservation_id` (P wrote it).
    `num_tokens`: the prompt size the router counted (informational; D checks the
    reservation against its own count). `push_deadline`: wall clock at which D stops
    waiting for P's landed notice (None: its --kv-landing-timeout)."""

    mode: ClassVar[str] = "notify"
    reservation_id: str
    num_tokens: int | None = None
    push_deadline: float | None = None


class PushPrefillParams(_Leg, frozen=True, kw_only=True):
    """P leg of push mode: hold the prompt's blocks until D registers, then WRITE them.
    `num_tokens` >= 0: prompt tokens the router counted. The notify_* keys, when set, ask
    for a KV-ready notice as in notify mode."""

    mode: ClassVar[str] = "push"
    num_tokens: int
    notify_endpoint: str | None = None
    notify_request_id: str | None = None
    notify_token: str | None = None


class PushDecodeParams(_Leg, frozen=True, kw_only=True):
    """D leg of push mode: register D's blocks with P's side channel (`remote_engine_id`,
    `remote_host`, `remote_port` 1..65535, `remote_agent_name`) and await P's WRITE.
    `push_deadline`: wall clock at which D stops waiting (None: its --kv-transfer-timeout).
    `continue_after_prefill`: continue after the token(s) P's landed notice names (the
    router streamed them from P's reply) instead of sampling, or fail."""

    mode: ClassVar[str] = "push"
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_agent_name: str | None = None
    num_tokens: int | None = None
    push_deadline: float | None = None
    continue_after_prefill: bool = False


class Continuation(msgspec.Struct, frozen=True, kw_only=True):
    """A decode continuing a stream the client already has: `first_token_ids` (non-empty,
    ints >= 0) are the tokens P sampled. Rides on a notify decode leg, or alone on a plain
    decode that recomputes the prompt. The engine checks them against its vocabulary and
    the request's max_tokens."""

    first_token_ids: list[int]

    def to_params(self) -> dict[str, object]:
        """The keys to merge into the decode leg's `kv_transfer_params`."""
        return {VERSION_KEY: KV_PARAMS_VERSION, "first_token_ids": list(self.first_token_ids)}


PdgateLeg = NotifyPrefillParams | NotifyDecodeParams | PushPrefillParams | PushDecodeParams
_Role = Literal["prefill", "decode"]


def parse_version(params: Mapping[str, object]) -> int:
    """The sender's contract version: 1 when the key is absent; refused when unknown."""
    v = params.get(VERSION_KEY)
    if v is None:
        return 1
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise KVParamsError(VERSION_KEY, f"must be an int >= 1, got {_short(v)}")
    if v > KV_PARAMS_VERSION:
        raise KVParamsError(VERSION_KEY, f"{v} is newer than this engine understands "
                            f"(it reads up to {KV_PARAMS_VERSION}); upgrade the engine first")
    return v


def parse_pdgate_params(params: Mapping[str, object]) -> PdgateLeg | None:
    """The pdgate leg `params` ask for, checked; None for vLLM's pull protocol or a request
    with neither role (`do_remote_decode` / `do_remote_prefill`). Raises KVParamsError
    naming the first bad key."""
    parse_version(params)
    mode = params.get(MODE_KEY)
    if mode is not None and mode != "pull" and mode not in MODES:
        raise KVParamsError(MODE_KEY, f"must be one of notify, push (absent: pull), got "
                            f"{_short(mode)}")
    role = _role(params)
    if params.get("continue_after_prefill") not in (None, False) and not (
            role == "decode" and mode == "push"):
        raise KVParamsError("continue_after_prefill", "needs a decode leg with pdgate_mode "
                            "push")
    if role is None or mode not in MODES:
        return None
    if mode == "notify":
        return parse_notify_prefill(params) if role == "prefill" else parse_notify_decode(params)
    return parse_push_prefill(params) if role == "prefill" else parse_push_decode(params)


def parse_notify_prefill(params: Mapping[str, object]) -> NotifyPrefillParams:
    """Check a notify P leg's keys (KVParamsError naming the first bad one)."""
    parse_version(params)
    return NotifyPrefillParams(
        remote_engine_id=_str(params, "remote_engine_id"),
        remote_host=_str(params, "remote_host"),
        remote_port=_port(params, "remote_port"),
        remote_block_ids=_block_ids(params, "remote_block_ids"),
        reservation_id=_str(params, "reservation_id"),
        num_tokens=_count(params, "num_tokens"),
        remote_agent_name=_opt_str(params, "remote_agent_name"),
        notify_endpoint=_opt_str(params, "notify_endpoint"),
        notify_request_id=_opt_str(params, "notify_request_id"),
        notify_token=_token(params, "notify_token"),
        write_deadline=_deadline(params, "write_deadline"),
    )


def parse_notify_decode(params: Mapping[str, object]) -> NotifyDecodeParams:
    """Check a notify D leg's keys (KVParamsError naming the first bad one)."""
    parse_version(params)
    return NotifyDecodeParams(
        reservation_id=_str(params, "reservation_id"),
        num_tokens=_opt_count(params, "num_tokens"),
        push_deadline=_deadline(params, "push_deadline"),
    )


def parse_push_prefill(params: Mapping[str, object]) -> PushPrefillParams:
    """Check a push P leg's keys (KVParamsError naming the first bad one)."""
    parse_version(params)
    return PushPrefillParams(
        num_tokens=_count(params, "num_tokens"),
        notify_endpoint=_opt_str(params, "notify_endpoint"),
        notify_request_id=_opt_str(params, "notify_request_id"),
        notify_token=_token(params, "notify_token"),
    )


def parse_push_decode(params: Mapping[str, object]) -> PushDecodeParams:
    """Check a push D leg's keys (KVParamsError naming the first bad one)."""
    parse_version(params)
    flag = params.get("continue_after_prefill", False)
    if not isinstance(flag, bool):
        raise KVParamsError("continue_after_prefill", f"must be a boolean, got {_short(flag)}")
    return PushDecodeParams(
        remote_engine_id=_str(params, "remote_engine_id"),
        remote_host=_str(params, "remote_host"),
        remote_port=_port(params, "remote_port"),
        remote_agent_name=_opt_str(params, "remote_agent_name"),
        num_tokens=_opt_count(params, "num_tokens"),
        push_deadline=_deadline(params, "push_deadline"),
        continue_after_prefill=flag,
    )


def parse_continuation(params: Mapping[str, object]) -> Continuation | None:
    """`first_token_ids` when present and non-empty (None otherwise); a prefill leg may
    not carry them. KVParamsError names the key when they are malformed."""
    parse_version(params)
    ids = params.get("first_token_ids")
    if ids is None or ids == []:
        return None
    checked = _ids(ids)
    if checked is None:
        raise KVParamsError("first_token_ids", f"must be a list of ints >= 0, got "
                            f"{_short(ids)}")
    if _role(params) == "prefill":
        raise KVParamsError("first_token_ids", "is for the decode leg")
    return Continuation(first_token_ids=checked)


def _role(params: Mapping[str, object]) -> _Role | None:
    if params.get("do_remote_decode") is True:
        return "prefill"
    if params.get("do_remote_prefill") is True:
        return "decode"
    return None


def _ids(v: object) -> list[int] | None:
    """`v` as a list of ints >= 0, or None when it is anything else."""
    if not isinstance(v, list):
        return None
    out: list[int] = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            return None
        out.append(x)
    return out


def _str(params: Mapping[str, object], key: str) -> str:
    v = params.get(key)
    if not isinstance(v, str) or not v:
        raise KVParamsError(key, f"must be a non-empty string, got {_short(v)}")
    return v


def _opt_str(params: Mapping[str, object], key: str) -> str | None:
    return None if params.get(key) is None else _str(params, key)


def _token(params: Mapping[str, object], key: str) -> str | None:
    v = params.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > NOTIFY_TOKEN_MAX_CHARS:
        shown = f"{len(v)} characters" if isinstance(v, str) else _short(v)
        raise KVParamsError(key, f"must be a string of at most {NOTIFY_TOKEN_MAX_CHARS} "
                            f"characters, got {shown}")
    return v


def _port(params: Mapping[str, object], key: str) -> int:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
        raise KVParamsError(key, f"must be an int in 1..65535, got {_short(v)}")
    return v


def _count(params: Mapping[str, object], key: str) -> int:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise KVParamsError(key, f"must be an int >= 0, got {_short(v)}")
    return v


def _opt_count(params: Mapping[str, object], key: str) -> int | None:
    return None if params.get(key) is None else _count(params, key)


def _block_ids(params: Mapping[str, object], key: str) -> list[int]:
    v = params.get(key)
    checked = _ids(v)
    if checked is None:
        raise KVParamsError(key, f"must be a list of ints >= 0, got {_short(v)}")
    return checked


def _deadline(params: Mapping[str, object], key: str) -> float | None:
    v = params.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not (
            math.isfinite(v) and v >= 0):
        raise KVParamsError(key, f"must be a finite time >= 0 (seconds since the epoch), "
                            f"got {_short(v)}")
    return float(v)


def _short(v: object) -> str:
    """A bad value for a message, cut short: it is echoed to whoever sent it."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
