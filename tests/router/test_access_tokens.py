"""What a real router (fake engines on loopback) counts and logs per request: the tokens the
client was billed, per model, and the fallback reason on the request's access line."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.router.conftest import MODEL, RunningRouter, sse_events
from tests.router.fake_engine import DECODE_PROMPT_TOKENS, PREFILL_PROMPT_TOKENS, FakeEngine

PD = tuple[FakeEngine, FakeEngine, RunningRouter]
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}


def tokens(router: RunningRouter) -> tuple[float, float]:
    labels = {"model": MODEL}
    return (router.metric("pdgate_prompt_tokens_total", labels),
            router.metric("pdgate_generation_tokens_total", labels))


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "pdgate.router.access"]  # type: ignore[attr-defined]


async def test_a_plain_answer_counts_the_usage_the_client_got(
    pd: PD, caplog: pytest.LogCaptureFixture,
) -> None:
    _, d, router = pd
    with caplog.at_level(logging.INFO, logger="pdgate.router.access"):
        resp = await router.client.post("/v1/completions", json=BODY)
    usage = resp.json()["usage"]
    # Billed from P's prompt count, D's completion count.
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        PREFILL_PROMPT_TOKENS, len(d.tokens))
    assert tokens(router) == (PREFILL_PROMPT_TOKENS, len(d.tokens))
    [line] = access_lines(caplog)
    assert (line["model"], line["prompt_tokens"], line["completion_tokens"]) == (
        MODEL, PREFILL_PROMPT_TOKENS, len(d.tokens))
    assert line["fallback"] is None


async def test_a_stream_counts_its_usage_chunk_once(pd: PD) -> None:
    _, d, router = pd
    resp = await router.client.post("/v1/completions", json={
        **BODY, "stream": True, "stream_options": {"include_usage": True}})
    [usage] = [e["usage"] for e in sse_events(resp.text)
               if isinstance(e, dict) and e.get("usage")]
    assert tokens(router) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert usage["completion_tokens"] == len(d.tokens)


async def test_a_stream_without_usage_chunks_is_counted_and_sent_none(pd: PD) -> None:
    _, d, router = pd
    resp = await router.client.post("/v1/completions", json={**BODY, "stream": True})
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    # D was asked for its usage chunk; the client, who did not ask, gets every token chunk
    # and no usage, and the router counted the tokens billed (prompt from P).
    assert d.requests[-1].body["stream_options"] == {"include_usage": True}
    chunks = [e for e in events if isinstance(e, dict)]
    assert len(chunks) == len(d.tokens) and all(c["choices"] and not c.get("usage")
                                                for c in chunks)
    assert tokens(router) == (PREFILL_PROMPT_TOKENS, len(d.tokens))


async def test_the_access_line_carries_the_fallback_reason(
    pd: PD, caplog: pytest.LogCaptureFixture,
) -> None:
    p, _, router = pd
    p.return_kv_params = False
    with caplog.at_level(logging.INFO, logger="pdgate.router.access"):
        resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    [line] = access_lines(caplog)
    assert line["fallback"] == "no_kv_params"
    # D recomputed the prompt: its own count is what the client was billed and counted.
    assert line["prompt_tokens"] == DECODE_PROMPT_TOKENS
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_kv_params"}) == 1
