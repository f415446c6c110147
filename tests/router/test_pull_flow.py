"""Pull mode end to end: what the engines receive and what the client gets back."""

from __future__ import annotations

import openai

from tests.router.conftest import MODEL, RunningRouter, sse_events
from tests.router.fake_engine import (
    DECODE_PROMPT_TOKENS,
    PREFILL_CACHED_TOKENS,
    PREFILL_PROMPT_TOKENS,
    FakeEngine,
)

PD = tuple[FakeEngine, FakeEngine, RunningRouter]

EXPECTED_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def test_prefill_leg_body_matches_the_nixl_contract(pd: PD) -> None:
    p, d, router = pd
    body = {
        "model": MODEL, "prompt": "Hello world", "max_tokens": 7, "max_completion_tokens": 7,
        "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2,
        "min_completion_tokens": 2, "temperature": 0.0, "my_engine_extension": {"x": 1},
    }
    resp = await router.client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    [prefill] = p.requests
    sent = prefill.body
    assert sent["kv_transfer_params"] == EXPECTED_PREFILL_KV
    assert sent["stream"] is False
    assert sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert dropped not in sent
    assert sent["prompt"] == "Hello world"
    assert sent["temperature"] == 0.0
    assert sent["my_engine_extension"] == {"x": 1}  # unknown fields pass through
    assert prefill.path == "/v1/completions"


async def test_decode_leg_gets_original_body_plus_p_params(pd: PD) -> None:
    p, d, router = pd
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 7, "min_tokens": 2, "foo": "bar"}
    resp = await router.client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    [prefill] = p.requests
    [decode] = d.requests
    assert decode.body["kv_transfer_params"] == p.kv_params(prefill)
    assert {k: v for k, v in decode.body.items() if k != "kv_transfer_params"} == body


async def test_same_request_id_on_both_legs_and_in_response(pd: PD) -> None:
    p, d, router = pd
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
    resp = await router.client.post("/v1/completions", json=body,
                                     headers={"X-Request-Id": "client-rid-1"})
    assert resp.headers["x-request-id"] == "client-rid-1"
    # Engines see the router's own id (clients reuse theirs), the same on both legs.
    internal = p.requests[0].headers["X-Request-Id"]
    assert internal != "client-rid-1" and d.requests[0].headers["X-Request-Id"] == internal

    resp = await router.client.post("/v1/completions", json=body)
    generated = resp.headers["x-request-id"]
    assert generated and generated != "client-rid-1"
    assert p.requests[1].headers["X-Request-Id"] == generated
    assert d.requests[1].headers["X-Request-Id"] == generated


async def test_response_names_the_engines_that_served_each_leg(pd: PD) -> None:
    p, d, router = pd
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
    resp = await router.client.post("/v1/completions", json=body)
    assert resp.headers["x-pdgate-prefill-engine"] == p.url
    assert resp.headers["x-pdgate-decode-engine"] == d.url
    resp = await router.client.post("/v1/completions", json={**body, "stream": True})
    assert resp.headers["x-pdgate-decode-engine"] == d.url


async def test_trace_headers_are_propagated(pd: PD) -> None:
    p, d, router = pd
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await router.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                             headers={"traceparent": tp})
    assert p.requests[0].headers["traceparent"] == tp
    assert d.requests[0].headers["traceparent"] == tp


async def test_non_streaming_usage_is_rewritten(pd: PD) -> None:
    p, d, router = pd
    resp = await router.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    reply = resp.json()
    assert reply["choices"][0]["text"] == "Hello world!"
    assert reply["usage"] == {
        "prompt_tokens": PREFILL_PROMPT_TOKENS,
        "completion_tokens": 3,
        "total_tokens": PREFILL_PROMPT_TOKENS + 3,
        "prompt_tokens_details": {"cached_tokens": PREFILL_CACHED_TOKENS},
    }


async def test_streaming_relays_chunks_and_rewrites_usage_chunk(pd: PD) -> None:
    p, d, router = pd
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await router.client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert [e["choices"][0]["text"] for e in events[:3]] == ["Hello", " world", "!"]
    assert events[3]["choices"] == []
    assert events[3]["usage"] == {
        "prompt_tokens": PREFILL_PROMPT_TOKENS, "completion_tokens": 3,
        "total_tokens": PREFILL_PROMPT_TOKENS + 3,
        "prompt_tokens_details": {"cached_tokens": PREFILL_CACHED_TOKENS},
    }
    assert events[4] == "[DONE]"
    assert d.requests[0].body["stream_options"] == {"include_usage": True}
    assert d.requests[0].body["stream"] is True


async def test_streaming_without_include_usage_has_no_usage(pd: PD) -> None:
    p, d, router = pd
    body = {"model": MODEL, "prompt": "Hello", "stream": True}
    resp = await router.client.post("/v1/completions", json=body)
    events = sse_events(resp.text)
    assert len(events) == 4 and events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


async def test_chat_flow_disaggregates_and_bills_from_prefill(pd: PD) -> None:
    p, d, router = pd
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}],
            "max_completion_tokens": 5}
    resp = await router.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    reply = resp.json()
    assert reply["choices"][0]["message"]["content"] == "Hello world!"
    assert reply["usage"]["prompt_tokens"] == PREFILL_PROMPT_TOKENS
    [prefill] = p.requests
    assert prefill.path == "/v1/chat/completions"
    assert prefill.body["max_tokens"] == 1 and prefill.body["max_completion_tokens"] == 1
    assert d.requests[0].path == "/v1/chat/completions"
    assert d.requests[0].body["max_completion_tokens"] == 5
    assert "max_tokens" not in d.requests[0].body


async def test_chat_streaming_with_usage(pd: PD) -> None:
    p, d, router = pd
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await router.client.post("/v1/chat/completions", json=body)
    events = sse_events(resp.text)
    text = "".join(e["choices"][0]["delta"]["content"] for e in events if
                   isinstance(e, dict) and e["choices"])
    assert text == "Hello world!"
    assert events[-2]["usage"]["prompt_tokens"] == PREFILL_PROMPT_TOKENS
    assert events[-1] == "[DONE]"


async def test_fallback_when_prefill_returns_no_params(pd: PD) -> None:
    p, d, router = pd
    p.return_kv_params = False
    resp = await router.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert resp.status_code == 200
    [decode] = d.requests
    assert "kv_transfer_params" not in decode.body
    # D computed the prompt itself, so its own usage is what the client is billed.
    assert resp.json()["usage"]["prompt_tokens"] == DECODE_PROMPT_TOKENS
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_kv_params"}) == 1


async def test_n_greater_than_one_skips_prefill(pd: PD) -> None:
    p, d, router = pd
    resp = await router.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello", "n": 2})
    assert resp.status_code == 200
    assert len(resp.json()["choices"]) == 2
    assert p.requests == []
    assert "kv_transfer_params" not in d.requests[0].body
    assert router.metric("pdgate_disagg_decisions_total", {"reason": "n_gt_1"}) == 1


async def test_batch_prompt_skips_prefill(pd: PD) -> None:
    p, d, router = pd
    resp = await router.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["Hello", "world"]})
    assert resp.status_code == 200
    assert p.requests == []
    assert d.requests[0].body["prompt"] == ["Hello", "world"]
    assert router.metric("pdgate_disagg_decisions_total", {"reason": "batch_prompt"}) == 1
    assert router.metric("pdgate_disagg_decisions_total", {"reason": "disagg"}) == 0


async def test_token_id_prompt_is_disaggregated(pd: PD) -> None:
    p, d, router = pd
    resp = await router.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [1, 264, 285], "max_tokens": 2})
    assert resp.status_code == 200
    assert p.requests[0].body["prompt"] == [1, 264, 285]
    assert router.metric("pdgate_disagg_decisions_total", {"reason": "disagg"}) == 1


async def test_openai_sdk_client(pd: PD) -> None:
    p, d, router = pd
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        comp = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert comp.choices[0].text == "Hello world!"
        assert comp.usage is not None and comp.usage.prompt_tokens == PREFILL_PROMPT_TOKENS
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
            stream_options={"include_usage": True})
        parts: list[str] = []
        usage = None
        async for chunk in stream:
            parts.extend(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(parts) == "Hello world!"
        assert usage is not None and usage.total_tokens == PREFILL_PROMPT_TOKENS + 3
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        try:
            await client.completions.create(model="nope", prompt="x")
        except openai.NotFoundError as exc:
            assert exc.code == "model_not_found"
        else:
            raise AssertionError("unknown model was accepted")
