"""Hostile request bodies are refused with a 4xx and bounded work (router/input/limits.py,
template_sandbox.py, template_workers.py).

Each attack is reproduced against a real router (uvicorn on loopback, fake engines) and
must come back as an OpenAI-style 4xx: nesting bombs and broken UTF-8 before anything is
decoded, client chat templates unless allowed (then sandboxed, off the event loop, within
their time and size budget), and prompts whose length alone proves they cannot fit before
they are tokenized. Only the router's HTTP surface is used here, so the file also runs
against a router without these bounds; the pieces are unit-tested in test_input_limits.py
and the whole under load in test_hostile_memory.py.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from pdgate.router.input.tokenization import PromptTokenizer
from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}


def completion(prompt: bytes) -> bytes:
    return b'{"model": "tiny", "max_tokens": 4, "prompt": ' + prompt + b"}"


def chat(content: bytes) -> bytes:
    return (b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": '
            + content + b"}]}")


def nested_arrays(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def nested_objects(depth: int) -> bytes:
    return b'{"a": ' * depth + b"1" + b"}" * depth


async def pd_router(make_engine: MakeEngine, start_router: StartRouter, **kw: Any
                    ) -> tuple[FakeEngine, FakeEngine, RunningRouter]:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    return p, d, await start_router([p], [d], **kw)


def assert_openai_4xx(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    err: dict[str, Any] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    return err


# --- 1. malformed JSON ------------------------------------------------------------------

DEPTH_BOMBS = {
    "arrays 999": nested_arrays(999),
    "objects 999": nested_objects(999),
    "arrays 100k": nested_arrays(100_000),
    "objects 100k": nested_objects(100_000),
    "unclosed 100k": b"[" * 100_000,
    "interleaved 5k": b"[[]," * 5000 + b"1" + b"]" * 5000,
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("bomb", list(DEPTH_BOMBS), ids=list(DEPTH_BOMBS))
async def test_deep_nesting_is_a_400(make_engine: MakeEngine, start_router: StartRouter,
                                     path: str, bomb: str) -> None:
    p, d, router = await pd_router(make_engine, start_router)
    wrap = completion if path == COMPLETIONS else chat
    for body in (wrap(DEPTH_BOMBS[bomb]), DEPTH_BOMBS[bomb]):
        err = assert_openai_4xx(await router.client.post(path, content=body, headers=JSON))
        assert "deeper than 32 levels" in err["message"]
    assert p.requests == [] and d.requests == []


BAD_STRINGS = {
    "overlong slash C0 AF": b'"\xc0\xaf"',
    "overlong E0 80 AF": b'"\xe0\x80\xaf"',
    "encoded surrogate ED A0 80": b'"\xed\xa0\x80"',
    "encoded low surrogate ED B0 80": b'"a\xed\xb0\x80b"',
    "above U+10FFFF F4 90 80 80": b'"\xf4\x90\x80\x80"',
    "stray FF": b'"\xff"',
    "truncated E2 82": b'"\xe2\x82"',
    "escaped lone high surrogate": b'"\\ud800"',
    "escaped lone high surrogate then text": b'"\\ud800x"',
    "escaped lone low surrogate": b'"\\udc00"',
    "escaped reversed pair": b'"\\udc00\\ud800"',
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("bad", list(BAD_STRINGS), ids=list(BAD_STRINGS))
async def test_invalid_utf8_and_surrogates_are_a_400(
    make_engine: MakeEngine, start_router: StartRouter, path: str, bad: str
) -> None:
    p, d, router = await pd_router(make_engine, start_router)
    wrap = completion if path == COMPLETIONS else chat
    as_key = b'{"model": "tiny", ' + BAD_STRINGS[bad] + b': 1, "prompt": "x"}'
    for body in (wrap(BAD_STRINGS[bad]), as_key):
        err = assert_openai_4xx(await router.client.post(path, content=body, headers=JSON))
        assert err["message"].startswith("request body is not valid")
    assert p.requests == [] and d.requests == []


async def test_surrogate_pairs_and_astral_text_still_reach_the_engine(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d, router = await pd_router(make_engine, start_router)
    body = b'{"model": "tiny", "max_tokens": 2, "prompt": "hi \\ud83d\\ude00 \xf0\x9f\x98\x80"}'
    resp = await router.client.post(COMPLETIONS, content=body, headers=JSON)
    assert resp.status_code == 200, resp.text
    assert d.requests[-1].body["prompt"] == "hi \U0001F600 \U0001F600"


async def test_too_many_messages_are_a_400(make_engine: MakeEngine,
                                           start_router: StartRouter) -> None:
    p, d, router = await pd_router(make_engine, start_router, max_model_len=100_000)
    body = {"model": MODEL, "max_tokens": 2, "messages": HI * 2049}
    err = assert_openai_4xx(await router.client.post(CHAT, json=body))
    assert err["param"] == "messages" and "2048" in err["message"]
    resp = await router.client.post(CHAT, json={**body, "messages": HI * 2048})
    assert resp.status_code == 200


async def test_max_messages_setting_is_enforced(make_engine: MakeEngine,
                                                start_router: StartRouter) -> None:
    p, d, router = await pd_router(make_engine, start_router, max_messages=3)
    body = {"model": MODEL, "max_tokens": 2, "messages": HI * 4}
    err = assert_openai_4xx(await router.client.post(CHAT, json=body))
    assert err["param"] == "messages"
    assert (await router.client.post(CHAT, json={**body, "messages": HI * 3})).status_code == 200
    assert len(d.requests) == 1


# --- 2. client chat templates -----------------------------------------------------------

LOOP_BOMB = ("{% for a in range(100000) %}{% for b in range(200) %}{% endfor %}{% endfor %}"
             "{{ messages[0].content }}")
# 150 bytes of template that renders 400 MB of prompt.
MEMORY_BOMB = "{% set s = 'x' * 4000000 %}{% for i in range(100) %}{{ s }}{% endfor %}"


def with_template(template: str, where: str) -> dict[str, Any]:
    extra: dict[str, Any] = ({"chat_template": template} if where == "body"
                             else {"chat_template_kwargs": {"chat_template": template}})
    return {"model": MODEL, "max_tokens": 2, "messages": HI, **extra}


@pytest.mark.parametrize("where", ["body", "chat_template_kwargs"])
async def test_client_chat_template_is_refused_unless_allowed(
    make_engine: MakeEngine, start_router: StartRouter, where: str
) -> None:
    p, d, router = await pd_router(make_engine, start_router)
    body = with_template("{{ messages[0].content }}", where)
    err = assert_openai_4xx(await router.client.post(CHAT, json=body))
    assert err["param"] == "chat_template"
    assert p.requests == [] and d.requests == []
    # Ordinary variables still reach the model's own template.
    ok = {"model": MODEL, "max_tokens": 2, "messages": HI,
          "chat_template_kwargs": {"enable_thinking": False}}
    assert (await router.client.post(CHAT, json=ok)).status_code == 200


async def _max_health_stall(client: httpx.AsyncClient, work: asyncio.Task[Any]) -> float:
    worst = 0.0
    while not work.done():
        t0 = time.perf_counter()
        assert (await client.get("/health")).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        await asyncio.sleep(0.01)
    return worst


@pytest.mark.parametrize("where", ["body", "chat_template_kwargs"])
async def test_template_loop_bomb_is_abandoned_and_health_stays_responsive(
    make_engine: MakeEngine, start_router: StartRouter, where: str
) -> None:
    p, d, router = await pd_router(make_engine, start_router,
                                   allow_client_chat_template=True,
                                   chat_template_timeout_s=0.5)
    # A first render starts the worker process; the bomb is then timed alone.
    warm = with_template("{{ 1 }}", where)
    assert (await router.client.post(CHAT, json=warm)).status_code == 200
    body = with_template(LOOP_BOMB, where)
    t0 = time.perf_counter()
    work = asyncio.create_task(router.client.post(CHAT, json=body))
    stall = await _max_health_stall(router.client, work)
    elapsed = time.perf_counter() - t0
    err = assert_openai_4xx(work.result())
    assert "took longer than 0.5 s" in err["message"]
    assert elapsed < 0.5 + 1.5, elapsed  # abandoned at the budget, not run to the end
    assert stall < 0.25, stall
    assert len(d.requests) == 1  # only the warm-up reached an engine


async def test_template_memory_bomb_is_refused(make_engine: MakeEngine,
                                               start_router: StartRouter) -> None:
    # A context so long that only the template's own output budget can stop the bomb
    # (with 4096 tokens, rendering stops as soon as the prompt cannot fit).
    p, d, router = await pd_router(make_engine, start_router,
                                   allow_client_chat_template=True,
                                   chat_template_timeout_s=0.5, max_model_len=10**7)
    for extra in ({"chat_template": MEMORY_BOMB},
                  {"chat_template_kwargs": {"chat_template": MEMORY_BOMB}}):
        body = {"model": MODEL, "max_tokens": 2, "messages": HI, **extra}
        err = assert_openai_4xx(await router.client.post(CHAT, json=body))
        assert "4194304 characters" in err["message"]
    surrogate = {"model": MODEL, "max_tokens": 2, "messages": HI,
                 "chat_template": "{{ '%c' % 55296 }}"}
    err = assert_openai_4xx(await router.client.post(CHAT, json=surrogate))
    assert "lone surrogate" in err["message"]
    fine = {"model": MODEL, "max_tokens": 2, "messages": HI,
            "chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                             "{% endfor %}"}
    assert (await router.client.post(CHAT, json=fine)).status_code == 200
    assert d.requests[-1].body["chat_template"] == fine["chat_template"]  # forwarded


# --- 3. context length before tokenizing ------------------------------------------------

class _SpyBackend:
    """The tokenizer backend, recording the length of every text it encodes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encoded: list[int] = []

    def encode(self, text: str, **kw: Any) -> Any:
        self.encoded.append(len(text))
        return self.inner.encode(text, **kw)

    def encode_batch(self, texts: list[str], **kw: Any) -> Any:
        self.encoded.extend(len(text) for text in texts)
        return self.inner.encode_batch(texts, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_prompt_that_cannot_fit_is_refused_before_tokenizing(
    make_engine: MakeEngine, start_router: StartRouter, tokenizer: PromptTokenizer,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _SpyBackend(tokenizer._backend)
    monkeypatch.setattr(tokenizer, "_backend", spy)
    p, d, router = await pd_router(make_engine, start_router)
    big = "The quick brown fox " * 195_000  # 3.9 MB, under max_body_bytes
    bodies = [(COMPLETIONS, {"model": MODEL, "prompt": big}),
              (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": big}]}),
              (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": big[:99_000]},
                                                   {"role": "user", "content": "end"}]})]
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(router.client.post(path, json=body)
                                     for path, body in bodies))
    elapsed = time.perf_counter() - t0
    for reply in replies:
        err = assert_openai_4xx(reply)
        assert err["code"] == "context_length_exceeded"
        assert "maximum context length is 4096 tokens" in err["message"]
        assert "you requested at least" in err["message"]
    assert spy.encoded == []  # nothing was tokenized
    assert p.requests == [] and d.requests == []
    # A prompt just under the bound is tokenized as before, and may still be too long.
    limit = tokenizer.char_limit(None)
    assert limit is not None and limit < len(big)
    reply = await router.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x" * limit})
    err = assert_openai_4xx(reply)
    assert err["code"] == "context_length_exceeded" and "at least" not in err["message"]
    assert spy.encoded == [limit]
    assert elapsed < 5.0, elapsed


async def refusal_cycles(router: RunningRouter) -> list[str]:
    """Names of the exceptions a refused request leaves in reference cycles. Objects in a
    cycle wait for a full GC, and with them every frame of the request (its body too):
    after a burst of refused multi-megabyte prompts, that memory stays."""
    body = {"model": MODEL, "prompt": "x" * 100_000}  # refused before tokenizing
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        assert (await router.client.post(COMPLETIONS, json=body)).status_code == 400
        await asyncio.sleep(0.05)
        gc.collect()
        return sorted({type(o).__name__ for o in gc.garbage
                       if isinstance(o, Exception) and not isinstance(o, asyncio.CancelledError)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_refused_request_is_freed_without_waiting_for_gc(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d, router = await pd_router(make_engine, start_router)
    assert await refusal_cycles(router) == []



async def test_configured_parse_limits_are_the_ones_enforced(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p, d, router = await pd_router(make_engine, start_router, max_json_depth=4,
                                   max_messages=2)
    nested = {"model": MODEL, "prompt": "hi", "max_tokens": 2,
              "logit_bias": {"1": 0}, "extra": [[[[1]]]]}
    resp = await router.client.post("/v1/completions", json=nested)
    assert resp.status_code == 400 and "nest" in resp.json()["error"]["message"].lower()
    chat = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}] * 3}
    resp = await router.client.post("/v1/chat/completions", json=chat)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    chat["messages"] = chat["messages"][:2]
    assert (await router.client.post("/v1/chat/completions", json=chat)).status_code == 200

