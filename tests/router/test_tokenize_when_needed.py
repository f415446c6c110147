"""The router tokenizes a prompt only when something reads its tokens (`tokenize_prompts`
"auto", the default): round-robin / least-inflight policies in pull mode forward the
prompt untouched and the engine's own context-length answer reaches the client; a
prefix-aware policy, a length rule of the decider or `tokenize_prompts: always` make the
router count tokens and refuse what cannot fit before any engine sees it. The router's
chat rules (no client template unless allowed) hold either way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
# Far beyond the tiny model's context length.
TOO_LONG = {"model": MODEL, "prompt": "word " * 5000, "max_tokens": 5000}


async def test_simple_policies_in_pull_mode_leave_the_context_check_to_the_engine(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    p.fail_status = 400  # the engine refuses the prompt, as vLLM does
    router = await start_router([p], [d], tokenize_prompts="auto")
    resp = await router.client.post("/v1/completions", json=TOO_LONG)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "fake failure 400"  # the engine's own words
    assert [r.body["prompt"] for r in p.requests] == [TOO_LONG["prompt"]]


@pytest.mark.parametrize("settings", [
    {"decode_policy": "prefix-aware"},
    {"prefill_policy": "prefix-aware"},
    {"disagg_min_tokens": 64},
    {"tokenize_prompts": "always"},
], ids=["prefix-aware decode", "prefix-aware prefill", "length rule", "always"])
async def test_token_readers_make_the_router_refuse_what_cannot_fit(
    make_engine: MakeEngine, start_router: StartRouter, settings: dict[str, Any]
) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    router = await start_router([p], [d], **{"tokenize_prompts": "auto", **settings})
    resp = await router.client.post("/v1/completions", json=TOO_LONG)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert "maximum context length" in err["message"] and err["param"] == "max_tokens"
    assert p.requests == [] and d.requests == []


async def test_client_chat_template_is_refused_without_tokenizing(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    router = await start_router([p], [d], tokenize_prompts="auto")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "chat_template": "{{ messages }}"}
    resp = await router.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "chat_template"
    assert p.requests == [] and d.requests == []
    ok = await router.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200
