"""Notify mode's early first token (router/flows/early.py) against recording fake engines:
the client's stream opens with P's token, D is asked to continue after it, and requests
whose first token could differ on D keep the plain flow."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tests.router.conftest import MODEL, RunningRouter, engine_rid, sse_events, until
from tests.router.fake_engine import FAKE_FIRST_TOKEN, FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
BODY = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "stream": True}


async def _cluster(make_engine: MakeEngine, start_router: StartRouter, *,
                   router_kw: dict[str, Any] | None = None, **p_kw: Any
                   ) -> tuple[FakeEngine, FakeEngine, RunningRouter]:
    p = await make_engine(engine_id="P0", first_token_ids=[FAKE_FIRST_TOKEN], **p_kw)
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode="notify", kv_ready_timeout_s=10.0,
                                **(router_kw or {}))
    return p, d, router


def _events(text: str) -> list[dict[str, Any]]:
    return [e for e in sse_events(text) if isinstance(e, dict)]


def _texts(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        for c in e.get("choices") or []:
            out.append(c["text"] if "text" in c else c["delta"].get("content") or "")
    return out


async def test_stream_opens_with_p_token_and_d_continues_after_it(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _cluster(make_engine, start_router)
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-e1"})
    assert resp.status_code == 200
    assert _texts(_events(resp.text)) == ["P", "Hello", " world", "!"]
    [decode] = d.decodes
    dkv = decode.body["kv_transfer_params"]
    assert dkv["first_token_ids"] == [FAKE_FIRST_TOKEN]
    assert dkv["do_remote_prefill"] is True and dkv["reservation_id"] == f"{engine_rid(p)}@1"
    assert decode.body["max_tokens"] == 4  # D counts P's token against the budget itself
    assert router.metric("pdgate_early_first_tokens_total", {"result": "kv"}) == 1
    assert p.aborts == [] and d.aborts == []


async def test_chat_stream_opens_with_the_role_then_p_token(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _cluster(make_engine, start_router)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    resp = await router.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    events = _events(resp.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["usage"] is None
    assert _texts(events)[1:] == ["P", "Hello", " world", "!"]
    assert events[-1]["usage"]["completion_tokens"] == 3  # as D reported it
    assert d.decodes[0].body["kv_transfer_params"]["first_token_ids"] == [FAKE_FIRST_TOKEN]


async def test_kv_lost_after_the_first_token_has_d_recompute_and_continue(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _cluster(make_engine, start_router, kv_ready="failed",
                                  kv_ready_delay_s=0.3)
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-lost"})
    assert resp.status_code == 200
    assert _texts(_events(resp.text)) == ["P", "Hello", " world", "!"]
    [decode] = d.decodes
    # No transfer to use: D computes the prompt, still continuing after P's token.
    assert decode.body["kv_transfer_params"] == {"first_token_ids": [FAKE_FIRST_TOKEN],
                                                 "pdgate_kv_version": 1}
    assert router.metric("pdgate_early_first_tokens_total", {"result": "recompute"}) == 1
    await until(lambda: p.aborts == [engine_rid(p)] and d.aborts == [engine_rid(p)])


async def test_requests_whose_first_token_may_differ_keep_the_plain_flow(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _cluster(make_engine, start_router)
    plain = [{"stop": ["x"]}, {"min_tokens": 2}, {"seed": 3}, {"max_tokens": 1},
             {"stream": False}]
    for extra in plain:
        resp = await router.client.post("/v1/completions", json={**BODY, **extra})
        assert resp.status_code == 200, (extra, resp.text)
    assert all("first_token_ids" not in r.body["kv_transfer_params"] for r in d.decodes)
    assert len(d.decodes) == len(plain)
    seeded_greedy = {**BODY, "seed": 3, "temperature": 0}
    resp = await router.client.post("/v1/completions", json=seeded_greedy)
    assert _texts(_events(resp.text))[0] == "P"
    assert router.metric("pdgate_early_first_tokens_total", {"result": "kv"}) == 1


async def test_p_without_first_token_ids_keeps_the_plain_flow(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0")  # an engine that does not report its token
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode="notify", kv_ready_timeout_s=10.0)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert _texts(_events(resp.text)) == ["Hello", " world", "!"]
    assert "first_token_ids" not in d.decodes[0].body["kv_transfer_params"]


async def test_early_token_can_be_turned_off(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _cluster(make_engine, start_router,
                                  router_kw={"early_first_token": False})
    resp = await router.client.post("/v1/completions", json=BODY)
    assert _texts(_events(resp.text)) == ["Hello", " world", "!"]
    assert "first_token_ids" not in d.decodes[0].body["kv_transfer_params"]



# ---- push mode: D learns P's token from P's landed notice --------------------------------

async def _push(make_engine: MakeEngine, start_router: StartRouter, **d_kw: Any
                ) -> tuple[FakeEngine, FakeEngine, RunningRouter]:
    p = await make_engine(engine_id="P0", first_token_ids=[FAKE_FIRST_TOKEN])
    d = await make_engine(engine_id="D0", **d_kw)
    router = await start_router([p], [d], pd_mode="push")
    return p, d, router


async def test_push_stream_opens_with_p_token_and_d_continues_after_it(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _push(make_engine, start_router)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    assert _texts(_events(resp.text)) == ["P", "Hello", " world", "!"]
    [decode] = d.decodes  # sent with P's leg, before P's token existed
    dkv = decode.body["kv_transfer_params"]
    assert dkv["continue_after_prefill"] is True and dkv["pdgate_mode"] == "push"
    assert "first_token_ids" not in dkv
    assert router.metric("pdgate_early_first_tokens_total", {"result": "kv"}) == 1


async def test_push_continuation_that_cannot_start_is_recomputed_after_p_token(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _push(make_engine, start_router, fail_continuations=True)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    assert _texts(_events(resp.text)) == ["P", "Hello", " world", "!"]
    first, again = d.decodes
    assert first.body["kv_transfer_params"]["continue_after_prefill"] is True
    assert again.body["kv_transfer_params"] == {"first_token_ids": [FAKE_FIRST_TOKEN],
                                                "pdgate_kv_version": 1}
    assert router.metric("pdgate_early_first_tokens_total", {"result": "recompute"}) == 1


async def test_push_without_kv_from_p_runs_a_plain_decode_leg(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0", first_token_ids=[FAKE_FIRST_TOKEN], push_params=False)
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode="push")
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-np"})
    assert resp.status_code == 200
    assert _texts(_events(resp.text)) == ["Hello", " world", "!"]  # nothing from P
    assert "kv_transfer_params" not in d.decodes[-1].body
    await until(lambda: engine_rid(p) in d.aborts)


async def test_push_client_leaving_after_p_token_frees_p_blocks(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    """P holds the prompt's blocks until D registers; a client that leaves before D's
    stream ended must not leave them pinned until P's TTL."""
    p, d, router = await _push(make_engine, start_router, first_token_delay_s=2.0)
    async with router.client.stream("POST", "/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-gone"}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break  # P's token arrived; the client walks away
    await until(lambda: engine_rid(p) in p.aborts)


async def test_push_finished_stream_does_not_abort_p(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _push(make_engine, start_router)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    await asyncio.sleep(0.2)
    assert p.aborts == []
