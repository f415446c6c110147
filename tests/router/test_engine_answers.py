"""Every engine answer is matched to the request it answers, and P's early first token is
verified, against faulty fake engines on loopback: an answer naming another request is a
502 (counted, nothing of it relayed), a `/v1/kv/*` reply without `engine_id` is a 502 (not
a 500), and a first token that fails its check keeps the plain flow. Never a wrong 200."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdgate.router.engines.replies import names_other_request
from tests.router.conftest import MODEL, RunningRouter, sse_events
from tests.router.fake_engine import FAKE_FIRST_TOKEN, FAKE_PROMPT_IDS, FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
OTHER = "0123456789abcdef0123456789abcdef"  # another request's router id (32 hex digits)
JSON_BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
STREAM_BODY = {**JSON_BODY, "stream": True}
EARLY_BODY = {"model": MODEL, "prompt": list(FAKE_PROMPT_IDS), "max_tokens": 5,
              "stream": True}


def refused(router: RunningRouter, reason: str) -> float:
    return router.metric("pdgate_engine_answers_refused_total", {"reason": reason})


def texts(body: str) -> list[str]:
    out = []
    for e in sse_events(body):
        if isinstance(e, dict):
            for c in e.get("choices") or []:
                out.append(c["text"] if "text" in c else c["delta"].get("content") or "")
    return out


@pytest.mark.parametrize("body", [JSON_BODY, STREAM_BODY], ids=["json", "stream"])
async def test_a_decode_answer_to_another_request_is_a_502(
        make_engine: MakeEngine, start_router: StartRouter, body: dict[str, Any]) -> None:
    p, d = await make_engine(), await make_engine(answer_id=f"cmpl-{OTHER}")
    router = await start_router([p], [d], max_retries=0)
    resp = await router.client.post("/v1/completions", json=body)
    assert resp.status_code == 502
    assert "another request" in resp.json()["error"]["message"]
    assert "Hello" not in resp.text and " world" not in resp.text  # nothing relayed
    assert refused(router, "request_id") == 1
    d.answer_id = None  # the engine recovers: the next request is served as usual
    again = await router.client.post("/v1/completions", json=body)
    assert again.status_code == 200 and "Hello" in again.text


async def test_a_prefill_answer_to_another_request_is_a_502(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d = await make_engine(answer_id=f"cmpl-{OTHER}"), await make_engine()
    router = await start_router([p], [d], max_retries=0)
    resp = await router.client.post("/v1/completions", json=JSON_BODY)
    assert resp.status_code == 502
    assert d.decodes == []  # D never got another request's KV to read
    assert refused(router, "request_id") == 1


@pytest.mark.parametrize("body", [JSON_BODY, STREAM_BODY, EARLY_BODY],
                         ids=["json", "stream", "early"])
async def test_another_requests_kv_params_are_refused(
        make_engine: MakeEngine, start_router: StartRouter, body: dict[str, Any]) -> None:
    p = await make_engine(kv_request_id=f"cmpl-{OTHER}-0-1a2b3c4d", token_ids=True)
    d = await make_engine()
    router = await start_router([p], [d], max_retries=0)
    resp = await router.client.post("/v1/completions", json=body)
    assert resp.status_code == 502
    assert d.decodes == []
    assert refused(router, "kv_params") == 1


async def test_kv_params_naming_this_request_as_vllm_does_are_read(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    """vLLM names its request `cmpl-<X-Request-Id>-<n>-<random>`: that is this request."""
    p, d = await make_engine(), await make_engine()
    router = await start_router([p], [d])
    resp = await router.client.post("/v1/completions", json=JSON_BODY)
    assert resp.status_code == 200
    rid = p.prefills[0].headers["X-Request-Id"]
    p.kv_request_id = f"cmpl-{rid}-0-1a2b3c4d"  # the next request's id differs: refused
    again = await router.client.post("/v1/completions", json=JSON_BODY)
    assert again.status_code == 502 and refused(router, "kv_params") == 1


class _NoEngineId(FakeEngine):
    """A shim-like engine whose `/v1/kv/info` and `/v1/kv/reserve` lack `engine_id`."""

    def info(self) -> dict[str, Any]:
        info = super().info()
        del info["engine_id"]
        return info


@pytest.mark.parametrize("mode", ["notify", "push"])
async def test_a_kv_reply_without_engine_id_is_a_502(
        make_engine: MakeEngine, start_router: StartRouter, mode: str) -> None:
    p, d = _NoEngineId(engine_id="P0"), _NoEngineId(engine_id="D0")
    for engine in (p, d):
        await engine.start()
    try:
        router = await start_router([p], [d], pd_mode=mode, max_retries=0)
        resp = await router.client.post("/v1/completions", json=JSON_BODY)
        assert resp.status_code == 502
        assert "engine_id" in resp.json()["error"]["message"]
    finally:
        for engine in (p, d):
            await engine.stop()


@pytest.mark.parametrize(("fault", "reason"), [
    ({"listed_prompt_ids": [9, 9, 9]}, "prompt_ids"),
    ({"first_token_text": "x" * 3_000_000}, "first_token"),
    ({"first_token_text": "Q"}, "first_token"),  # not what P's token id decodes to
])
async def test_a_pull_first_token_that_fails_its_check_keeps_the_plain_flow(
        make_engine: MakeEngine, start_router: StartRouter, fault: dict[str, Any],
        reason: str) -> None:
    p, d = await make_engine(token_ids=True, **fault), await make_engine()
    router = await start_router([p], [d], max_engine_reply_bytes=8 << 20)
    resp = await router.client.post("/v1/completions", json=EARLY_BODY)
    assert resp.status_code == 200
    assert texts(resp.text) == list(d.tokens)  # D's answer alone, no text of P's
    assert d.decodes[-1].body["prompt"] == list(FAKE_PROMPT_IDS)  # the client's prompt
    assert refused(router, reason) == 1
    assert router.metric("pdgate_early_first_tokens_total", {"result": "kv"}) == 0


@pytest.mark.parametrize("text", ["x" * 1000, "Q"])
async def test_a_pushed_first_token_that_fails_its_check_keeps_the_plain_flow(
        make_engine: MakeEngine, start_router: StartRouter, text: str) -> None:
    p = await make_engine(engine_id="P0", first_token_ids=[FAKE_FIRST_TOKEN],
                          first_token_text=text)
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode="notify", kv_ready_timeout_s=10.0)
    resp = await router.client.post("/v1/completions", json={**STREAM_BODY,
                                                              "prompt": "Hello world"})
    assert resp.status_code == 200
    assert texts(resp.text) == list(d.tokens)
    assert "first_token_ids" not in d.decodes[-1].body["kv_transfer_params"]
    assert refused(router, "first_token") == 1


MINE = "fedcba9876543210fedcba9876543210"


@pytest.mark.parametrize(("answered", "other"), [
    (f"cmpl-pdgate-{MINE}-0", False),
    (f"chatcmpl-{MINE}-1-{'x' * 20}", False),  # 64 characters: no room for another id
    (f"{OTHER}-{MINE}", True),  # 65: the shortest value naming two ids
    (f"cmpl-{OTHER}", True),
    (f"{MINE}abc-{OTHER[:31]}", False),  # ours unbounded, no other bounded run
    (f"{'y' * 40}{MINE}-{OTHER}", True),  # long: scanned
])
def test_an_answer_id_names_another_request_exactly_as_the_scan_says(
        answered: str, other: bool) -> None:
    """The short-answer shortcut of names_other_request agrees with the full scan."""
    rid = f"pdgate-{MINE}"
    assert names_other_request(answered, rid) is other
    assert names_other_request(answered, f"{rid}-2") is other  # an attempt's suffix
