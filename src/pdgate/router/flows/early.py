"""The early first token, one module for every flow: P's one-token reply opens the client's
stream as soon as it arrives, and D continues after that token instead of sampling it again.

How D learns the token differs per flow (the flows supply it):
- pull (and push with vLLM engines): P is asked for `return_token_ids`; D gets the client's
  body with the prompt given as P's ids plus P's token, one token fewer to generate
  (`continuation`), and P's `kv_transfer_params`;
- notify: the decode leg names the token in `kv_transfer_params.first_token_ids`;
- push (shim): the decode leg, sent before the token existed, says
  `continue_after_prefill` and D reads the token from P's landed notice.

TTFT becomes P's prefill plus one hop. Only requests whose first token means the same on P
and D qualify (`eligible`): whatever makes a token depend on more than the prompt and the
sampler (stop strings that may span tokens, min_tokens, seeded sampling, logprobs,
structured output, n > 1) keeps the plain flow.

P's token is verified before the client sees it (`FirstTokenCheck`): the prompt ids P lists
must be the client's when the router knows them (it tokenized, or the client sent ids); the
token's text is bounded, and must be what its id decodes to when the router has the
tokenizer. A token that fails keeps the plain flow (counted in
`pdgate_engine_answers_refused_total{reason}`). `EarlyStream` is the client's stream: P's
token, then whatever the flow opens to continue it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from pdgate.router.engines.replies import (
    PrefillReply,
    PrefillUsage,
    rewrite_continuation_usage,
)
from pdgate.router.input.schema import ClientRequest

__all__ = ["ASK_TOKEN_IDS", "MAX_TOKEN_CHARS", "EarlyStream", "FirstToken", "FirstTokenCheck",
           "TokenText", "bill", "continuation", "eligible", "head_chunks", "wants_early"]

_json_encode = msgspec.json.Encoder().encode
PARTIAL_CHAR = "\ufffd"  # what a detokenizer shows for an incomplete multi-byte character
ASK_TOKEN_IDS = "return_token_ids"
# The completions API's `max_tokens` when the client gives none (OpenAI legacy, vLLM, shim):
# the continuation must then ask for that many minus P's tokens, not the default again.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# One token's text is a few characters (the longest in common vocabularies: runs of spaces
# or punctuation, well under 64); more is not a token an engine sampled.
MAX_TOKEN_CHARS = 128
# Prompt ids decoded before P's token so its text comes out as in the stream (a leading
# space, a character completed by the token); a detokenizer needs only a few.
_CONTEXT_IDS = 8
# Body keys whose presence (non-null, non-empty) keeps a request on the plain flow.
_BLOCKING_SET = frozenset((
    "stop", "logprobs", "top_logprobs", "echo", "suffix", "min_tokens",
    "min_completion_tokens", "tools", "functions", "response_format", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "logit_bias",
    "prompt_logprobs"))
# Values of those keys that ask for nothing (compared with ==, as `in` does).
_UNSET: tuple[object, ...] = (None, False, [], {}, "", 0)


def eligible(req: ClientRequest) -> bool:
    """True when P's first token can be streamed early for `req` (see the module doc)."""
    body = req.body
    if not req.stream or req.n != 1 or body.get("best_of") not in (None, 1):
        return False
    for key in body.keys() & _BLOCKING_SET:  # mostly none: one set operation in C
        if body[key] not in _UNSET:
            return False
    max_tokens = req.max_tokens
    if max_tokens is not None and max_tokens < 2:
        return False  # P's token is the whole answer: nothing to continue
    if body.get("seed") is not None and body.get("temperature") != 0:
        return False  # D's seeded sampler would start one token late
    opts = body.get("stream_options")
    return not (isinstance(opts, Mapping) and opts.get("continuous_usage_stats"))


def wants_early(req: ClientRequest) -> bool:
    """May `req`'s first token come from P's listed ids (pull, push with vLLM)? The
    completions API with one prompt: chat's D leg cannot take token ids."""
    return (req.kind == "completion" and not req.batch and eligible(req)
            and not req.body.get(ASK_TOKEN_IDS))


class TokenText(Protocol):
    """The router's tokenizer, as far as the check needs it."""

    def token_text(self, ids: Sequence[int], before: Sequence[int] = ()) -> str: ...


@dataclass(frozen=True, slots=True)
class FirstToken:
    """P's token as it may open the client's stream: its reply, text and ids, and (pull)
    the prompt ids P listed."""

    reply: PrefillReply
    text: str
    token_ids: list[int]
    prompt_ids: list[int]


class FirstTokenCheck:
    """Verifies P's first token before a client gets it (see the module doc). `refused`
    counts each token that failed, by reason (`prompt_ids`, `first_token`); `withheld`
    each sound one that still keeps the plain flow, by reason (`partial_character`: it is
    part of a character; `full_block`: P's blocks may be exactly full). Those streams get
    D's first token after the transfer instead of P's at once, tens of ms later: an
    operator reading a bimodal TTFT finds why here."""

    def __init__(self, tokenizer: TokenText | None, refused: Callable[[str], None],
                 withheld: Callable[[str], None]) -> None:
        self._tok = tokenizer
        self._refused = refused
        self._withheld = withheld

    def listed(self, req: ClientRequest, reply: PrefillReply) -> FirstToken | None:
        """P's token from the ids it listed (`return_token_ids`), or None: the plain flow."""
        listed = reply.listed_ids()
        if listed is None:
            return None
        prompt_ids, token_ids = listed
        known = _known_prompt(req)
        if known is not None and prompt_ids != known:
            self._refused("prompt_ids")
            return None
        text = self._text(req, reply, token_ids, prompt_ids)
        if text is None:
            return None  # refused, counted
        # No text, or a replacement character: P's token is part of a split character
        # (vLLM holds such a token's text back). Given the prompt as ids ending in such a
        # token, vLLM's decode engine streamed the whole prompt's text back before its own.
        if not text or PARTIAL_CHAR in text:
            self._withheld("partial_character")
            return None
        if not reply.room_in_last_block(len(prompt_ids)):
            self._withheld("full_block")
            return None
        return FirstToken(reply, text, token_ids, prompt_ids)

    def pushed(self, req: ClientRequest, reply: PrefillReply) -> FirstToken | None:
        """P's token from its pushed params' `first_token_ids` (notify, push), or None."""
        ids = reply.pushed_first_tokens()
        if ids is None:
            return None
        text = self._text(req, reply, ids, _known_prompt(req) or [])
        if text is None:
            return None
        if text.endswith(PARTIAL_CHAR):
            # P flushed a split character at its budget; D holds it back until the
            # character is complete and sends it then, so the client must not get it now.
            text = ""
        return FirstToken(reply, text, ids, [])

    def _text(self, req: ClientRequest, reply: PrefillReply, ids: list[int],
              prompt: Sequence[int]) -> str | None:
        """P's text for `ids`, or None (refused) when it is over its bound or is not what
        the ids decode to."""
        text = reply.text(req.kind == "chat") or ""
        if len(text) > MAX_TOKEN_CHARS * len(ids):
            self._refused("first_token")
            return None
        if self._tok is not None and text and PARTIAL_CHAR not in text:
            context = list(prompt[-_CONTEXT_IDS:])
            decoded = self._tok.token_text(ids, context)
            # Without the prompt's ids a first token's leading space may decode differently.
            if text != decoded and (context or text.lstrip() != decoded.lstrip()):
                self._refused("first_token")
                return None
        return text


def _known_prompt(req: ClientRequest) -> list[int] | None:
    """The prompt's ids when the router knows them: it tokenized, or the client sent ids."""
    if req.prompt_token_ids is not None:
        return req.prompt_token_ids
    return req.prompt if isinstance(req.prompt, list) else None


def continuation(body: Mapping[str, Any], first: FirstToken) -> dict[str, Any]:
    """The client's body as D continues it: prompt = P's ids plus its token, that many
    tokens fewer to generate (the decode leg adds the KV params)."""
    b = dict(body)
    b["prompt"] = first.prompt_ids + first.token_ids
    b.pop(ASK_TOKEN_IDS, None)
    if b.get("max_tokens") is None and b.get("max_completion_tokens") is None:
        b["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(b.get(key), int):
            b[key] -= len(first.token_ids)
    return b


def bill(usage: dict[str, Any], first: FirstToken, prefill: PrefillUsage | None) -> None:
    """D's usage object made the client's when D was given P's token as prompt: the
    prompt as P counted it, P's token among the completion tokens."""
    rewrite_continuation_usage(usage, prefill, len(first.prompt_ids), len(first.token_ids))


def head_chunks(first: FirstToken, chat: bool, include_usage: bool,
                token_ids: bool = False) -> bytes:
    """SSE events that open the client's stream with P's token (chat: the role delta first),
    shaped like the engine's own chunks so the decode leg's continue them seamlessly. With
    `token_ids` (the router tracks ids for migration) the token's chunk lists its ids as
    vLLM's `return_token_ids` does, sent even when its text is held back (a split
    character)."""
    reply = first.reply.reply
    base = {"id": reply.id, "object": "chat.completion.chunk" if chat else
            "text_completion", "created": reply.created, "model": reply.model}
    ids = {"token_ids": list(first.token_ids)} if token_ids else {}
    events: list[dict[str, Any]] = []
    if chat:
        role = {"delta": {"role": "assistant", "content": ""}}
        if first.text:
            events.append(_choice(base, role))
            events.append(_choice(base, {"delta": {"content": first.text}, **ids}))
        else:
            events.append(_choice(base, {**role, **ids}))
    elif first.text or token_ids:
        events.append(_choice(base, {"text": first.text, **ids}))
    if include_usage:
        for event in events:
            event["usage"] = None  # as the engine's chunks: null until the last
    return b"".join(b"data: " + _json_encode(e) + b"\n\n" for e in events)


def _choice(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    choice = {"index": 0, **fields, "logprobs": None, "finish_reason": None,
              "stop_reason": None}
    return {**base, "choices": [choice]}


Rest = Callable[[contextlib.ExitStack], Awaitable[AsyncIterator[bytes]]]


class EarlyStream:
    """The client's stream with an early first token: `head` (P's token), then the chunks
    of what `rest` opens to continue it (its resources closed with the stack it is given).
    `on_close(self)` runs when the stream closes: `opened` says whether `rest` returned,
    `finished` whether its chunks ran to their end (the flow frees what it still holds)."""

    def __init__(self, head: bytes, rest: Rest,
                 on_close: Callable[[EarlyStream], None] | None = None) -> None:
        self._head = head
        self._rest = rest
        self._on_close = on_close
        self._stack = contextlib.ExitStack()
        self.opened = False
        self.finished = False
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._head:
            yield self._head
        chunks = await self._rest(self._stack)
        self.opened = True
        async for chunk in chunks:
            yield chunk
        self.finished = True

    def close(self) -> None:
        """Close what `rest` opened, then tell the flow (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stack.close()
        finally:
            if self._on_close is not None:
                self._on_close(self)
