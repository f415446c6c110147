"""The pull flow's early first token, against fake engines on loopback: P's token opens the
client's stream, D is asked to continue after it, the client is billed for its own request,
and a decode that fails after the first byte still ends the stream cleanly and frees P."""

from __future__ import annotations

from typing import Any

from tests.router.conftest import MODEL, RunningRouter, sse_events
from tests.router.fake_engine import FAKE_FIRST_TOKEN, FAKE_PROMPT_IDS
from tests.router.test_ops import eventually

# The client sends ids, so the router knows the prompt's ids and checks P's list against them.
BODY: dict[str, Any] = {"model": MODEL, "prompt": list(FAKE_PROMPT_IDS), "max_tokens": 5,
                        "stream": True, "stream_options": {"include_usage": True}}


def texts(events: list[Any]) -> list[str]:
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")]


async def test_p_token_opens_the_stream_and_d_continues_after_it(
    make_engine: Any, start_router: Any,
) -> None:
    p, d = await make_engine(token_ids=True), await make_engine()
    router: RunningRouter = await start_router([p], [d])
    resp = await router.client.post("/v1/completions", json=BODY)
    events = sse_events(resp.text)
    assert texts(events) == ["P", *d.tokens] and events[-1] == "[DONE]"
    # D is chosen before the first byte, so the headers name both engines.
    assert resp.headers["x-pdgate-prefill-engine"] == p.url
    assert resp.headers["x-pdgate-decode-engine"] == d.url
    assert p.prefills[-1].body["return_token_ids"] is True
    cont = d.decodes[-1].body
    # D gets the prompt as P's ids plus P's token, one token less, and P's KV params.
    assert cont["prompt"] == [*FAKE_PROMPT_IDS, FAKE_FIRST_TOKEN]
    # (D lists its token ids for the router alone: the stream may migrate; the client's
    # chunks carry none.)
    assert cont["max_tokens"] == 4 and cont["return_token_ids"] is True
    assert all("token_ids" not in c for e in events[:-1] for c in e["choices"])
    assert cont["kv_transfer_params"]["remote_engine_id"] == p.engine_id
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")][-1]
    assert usage["completion_tokens"] == len(d.tokens) + 1  # P's token is the client's
    assert router.metric("pdgate_early_first_tokens_total", {"result": "kv"}) == 1
    assert p.aborts == []  # D read the KV: nothing to free


async def test_an_engine_without_token_ids_keeps_the_plain_stream(
    make_engine: Any, start_router: Any,
) -> None:
    p, d = await make_engine(), await make_engine()
    router: RunningRouter = await start_router([p], [d])
    resp = await router.client.post("/v1/completions", json=BODY)
    assert texts(sse_events(resp.text)) == list(d.tokens)
    assert d.decodes[-1].body["prompt"] == list(FAKE_PROMPT_IDS)
    assert router.metric("pdgate_early_first_tokens_total", {"result": "kv"}) == 0


async def test_a_failed_kv_read_is_retried_after_the_first_token_without_the_kv(
    make_engine: Any, start_router: Any,
) -> None:
    p, d = await make_engine(token_ids=True), await make_engine(fail_kv_loads=True)
    router: RunningRouter = await start_router([p], [d])
    resp = await router.client.post("/v1/completions", json=BODY)
    events = sse_events(resp.text)
    # The retry recomputes the prompt on D, still continuing after P's token.
    assert texts(events) == ["P", *d.tokens] and events[-1] == "[DONE]"
    assert d.decodes[-1].body["prompt"] == [*FAKE_PROMPT_IDS, FAKE_FIRST_TOKEN]
    assert "kv_transfer_params" not in d.decodes[-1].body
    assert router.metric("pdgate_early_first_tokens_total", {"result": "recompute"}) == 1
    await eventually(lambda: len(p.aborts) == 1, "P frees the blocks nobody read")


async def test_no_decode_engine_after_the_first_token_ends_with_an_error_event(
    make_engine: Any, start_router: Any,
) -> None:
    p, d = await make_engine(token_ids=True), await make_engine(fail_status=503)
    router: RunningRouter = await start_router([p], [d])
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200  # the first token was already sent
    events = sse_events(resp.text)
    assert texts(events) == ["P"]
    assert "error" in events[-2] and events[-1] == "[DONE]"
    # The stream's continuations (mid-stream migration, --max-migrations 2) found no D
    # either: P frees the blocks of every prefill nobody read, the first and the
    # continuations'.
    prefilled = {r.headers.get("X-Request-Id") for r in p.prefills}
    assert len(prefilled) >= 2
    await eventually(lambda: set(p.aborts) == prefilled, "P frees the blocks nobody read")


async def test_chat_and_non_eligible_streams_keep_the_plain_flow(
    make_engine: Any, start_router: Any,
) -> None:
    p, d = await make_engine(token_ids=True), await make_engine()
    router: RunningRouter = await start_router([p], [d])
    await router.client.post("/v1/completions", json={**BODY, "stop": ["x"]})
    await router.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert all("return_token_ids" not in r.body for r in p.prefills)
    assert router.metric("pdgate_early_first_tokens_total", {"result": "kv"}) == 0
