"""What mid-stream migration needs to know about a request and its chunks, as pure functions:
whether a stream may be continued elsewhere (`declined`), the continuation's body (a
completion over the prompt's ids plus the tokens the client has), its budget and the
request's stop strings (`stop_rule`). How the
continuation's chunks are made to read as the client's own stream is
router/engines/resume_events.py (engine replies are parsed only in engines/).

The flow that uses them is router/flows/migration.py; docs/flows.md says what is guaranteed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdgate.router.engines.resume_text import StopRule
from pdgate.router.flows.early import ASK_TOKEN_IDS, COMPLETIONS_DEFAULT_MAX_TOKENS
from pdgate.router.input.schema import ClientRequest

__all__ = ["continuation_body", "declined", "greedy", "remaining_budget", "stop_rule"]

# Body keys whose presence (non-null, non-empty, non-zero) makes a stream non-migratable,
# by the reason counted in `pdgate_migrations_declined_total{reason}`:
# - logprobs: per-token data the continuation would report for a different prompt;
# - structured: a grammar or tool parser whose state is not in the token ids;
# - sampling: penalties and minimums computed over the output tokens, which the
#   continuation sees as prompt.
_DECLINE: tuple[tuple[str, frozenset[str]], ...] = (
    ("logprobs", frozenset(("logprobs", "top_logprobs", "echo", "prompt_logprobs",
                            "suffix"))),
    ("structured", frozenset(("tools", "functions", "response_format", "guided_json",
                              "guided_regex", "guided_choice", "guided_grammar",
                              "structured_outputs"))),
    ("sampling", frozenset(("presence_penalty", "frequency_penalty", "min_tokens",
                            "min_completion_tokens"))),
)
_UNSET: tuple[object, ...] = (None, False, [], {}, "", 0)
# A chat request's fields that mean the same in a completion (the continuation is one).
_CHAT_CARRY = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
               "include_stop_str_in_output",
               "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
               "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "user",
               "priority")


def declined(req: ClientRequest, max_model_len: int | None) -> str | None:
    """Why `req`'s stream cannot be migrated (a reason label), or None when it can."""
    body = req.body
    if req.batch or req.n != 1 or body.get("best_of") not in (None, 1):
        return "n"
    for reason, keys in _DECLINE:
        for key in body.keys() & keys:
            if body[key] not in _UNSET:
                return reason
    rule = stop_rule(req)
    if rule is None:
        return "stop"  # not strings (the engine refuses it before any byte anyway)
    if rule.hold and not greedy(req):
        # The continuation generates the held-back text again, which the client has in
        # part: only greedy decoding is sure to generate the same.
        return "stop"
    if body.get(ASK_TOKEN_IDS):
        return "token_ids"  # the client reads ids the continuation would list again
    opts = body.get("stream_options")
    if isinstance(opts, Mapping) and opts.get("continuous_usage_stats"):
        return "usage_stats"
    if req.kind == "chat" and req.max_tokens is None and max_model_len is None:
        return "no_budget"  # the continuation's budget would be the completions default
    return None


def greedy(req: ClientRequest) -> bool:
    """`req` decodes greedily (vLLM: a temperature below 1e-5)."""
    t = req.body.get("temperature")
    return isinstance(t, int | float) and not isinstance(t, bool) and t < 1e-5


def stop_rule(req: ClientRequest) -> StopRule | None:
    """`req`'s stop strings as the engine reads them (vLLM: `stop`, a string or a list of
    non-empty strings; `include_stop_str_in_output`), or None when they are not that."""
    stop, include = req.body.get("stop"), req.body.get("include_stop_str_in_output")
    strings = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings)
            or include not in (None, True, False)):
        return None
    return StopRule(tuple(strings), bool(include))


def remaining_budget(req: ClientRequest, kept: int, prompt_len: int,
                     max_model_len: int | None) -> int:
    """Tokens the continuation may still generate: what is left of the client's
    `max_tokens` / `max_completion_tokens` (completions default: 16; chat without one:
    the context left) after the `kept` tokens its prompt carries."""
    asked = req.max_tokens
    if asked is None:
        if req.kind == "completion":
            asked = COMPLETIONS_DEFAULT_MAX_TOKENS
        else:
            assert max_model_len is not None  # `declined`: no_budget
            return max_model_len - prompt_len - kept
    return asked - kept


def continuation_body(req: ClientRequest, prompt: list[int], budget: int) -> dict[str, Any]:
    """The continuation's completion body: `prompt` (the original prompt's ids plus the
    tokens kept), `budget` tokens, streamed with usage (its decode legs add the ask for
    token ids: the continuation is a request with `track_ids`)."""
    if req.kind == "completion":
        b = {k: v for k, v in req.body.items()
             if k not in ("kv_transfer_params", "max_completion_tokens")}
    else:
        b = {k: req.body[k] for k in _CHAT_CARRY if k in req.body}
    b["prompt"] = prompt
    b["max_tokens"] = budget
    b["stream"] = True
    b["stream_options"] = {"include_usage": True}
    return b
