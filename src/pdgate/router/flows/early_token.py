"""The early first token of the notify and push flows: P's one-token reply is streamed to the
client as soon as it arrives, while P's KV is still being written into D; D then continues
after that token instead of sampling it again (notify: the decode leg names it in
`kv_transfer_params.first_token_ids`; push: the decode leg, sent before the token existed,
says `continue_after_prefill` and D reads the token from P's landed notice).

TTFT becomes P's prefill plus one hop, with no KV-ready wait, decode-leg round trip or D step
in it. Only requests whose first token means the same on P and D qualify: whatever makes a
token depend on more than the prompt and the sampler (stop strings that may span tokens,
min_tokens, seeded sampling, logprobs, structured output, n > 1) keeps the plain flow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from pdgate.router.input.schema import ClientRequest

__all__ = ["PARTIAL_CHAR", "eligible", "first_token_ids", "head_chunks"]

_json_encode = msgspec.json.Encoder().encode
PARTIAL_CHAR = "\ufffd"  # what a detokenizer shows for an incomplete multi-byte character
# Body keys whose presence (non-null, non-empty) keeps a request on the plain notify flow.
_BLOCKING_KEYS = ("stop", "logprobs", "top_logprobs", "echo", "suffix", "min_tokens",
                  "min_completion_tokens", "tools", "functions", "response_format",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs", "logit_bias", "prompt_logprobs")
_BLOCKING_SET = frozenset(_BLOCKING_KEYS)
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


def first_token_ids(reply: Mapping[str, Any]) -> list[int] | None:
    """The tokens P sampled, when its reply shows it pushed its KV and stopped only at its
    one-token budget; else None (the plain flow runs)."""
    choices = reply.get("choices")
    params = reply.get("kv_transfer_params")
    if not (isinstance(choices, list) and len(choices) == 1 and isinstance(params, Mapping)):
        return None
    choice = choices[0]
    if not isinstance(choice, Mapping) or choice.get("finish_reason") != "length":
        return None
    ids = params.get("first_token_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
        return None
    return list(ids)


def head_chunks(reply: Mapping[str, Any], chat: bool, include_usage: bool) -> bytes:
    """SSE events that open the client's stream with P's token (chat: the role delta first),
    shaped like the engine's own chunks so the decode leg's continue them seamlessly."""
    choice = reply["choices"][0]
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    if not isinstance(text, str) or text.endswith(PARTIAL_CHAR):
        # P flushed a split character at its budget; D holds it back until the character
        # is complete and sends it then, so the client must not get it now.
        text = ""
    base = {"id": reply.get("id"), "object": "chat.completion.chunk" if chat else
            "text_completion", "created": reply.get("created"), "model": reply.get("model")}
    events: list[dict[str, Any]] = []
    if chat:
        events.append(_choice(base, {"delta": {"role": "assistant", "content": ""}}))
        if text:
            events.append(_choice(base, {"delta": {"content": text}}))
    elif text:
        events.append(_choice(base, {"text": text}))
    if include_usage:
        for event in events:
            event["usage"] = None  # as the engine's chunks: null until the last
    return b"".join(b"data: " + _json_encode(e) + b"\n\n" for e in events)


def _choice(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    choice = {"index": 0, **fields, "logprobs": None, "finish_reason": None,
              "stop_reason": None}
    return {**base, "choices": [choice]}
