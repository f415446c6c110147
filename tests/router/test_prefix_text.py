"""`prefix-text`: prefix affinity on the prompt's text, with no tokenizer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import PickContext, PolicyEnv, build_policy, choose
from pdgate.router.policies.prefix_index import PrefixIndex
from pdgate.router.pool import EndpointPool

SYSTEM = "You are a careful assistant. " * 40  # ~1160 characters: 4 full 256-char blocks


def make_pool(n: int) -> EndpointPool:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(n)]
    return EndpointPool(urls, urls, RouterMetrics.create(CollectorRegistry()))


def test_needs_no_tokenizer() -> None:
    assert not build_policy("prefix-text").needs_tokens


async def test_a_shared_prefix_follows_its_engine_and_a_new_one_spreads() -> None:
    pool = make_pool(3)
    env = PolicyEnv(approx=PrefixIndex(10_000))
    policy = build_policy("prefix-text", env)

    async def pick(ctx: PickContext) -> int:
        return (await choose(pool, "decode", policy, ctx)).index

    first = await pick(PickContext("a", prompt=SYSTEM + "question one"))
    assert await pick(PickContext("b", prompt=SYSTEM + "question two")) == first
    other = await pick(PickContext("c", prompt="Something else entirely. " * 60))
    assert other != first  # spread: the engine holding nothing wins the tie


async def test_chat_messages_are_matched_as_text() -> None:
    pool = make_pool(2)
    env = PolicyEnv(approx=PrefixIndex(10_000))
    policy = build_policy("prefix-text", env)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    first = await choose(pool, "decode", policy, PickContext("a", messages=chat))
    chat2 = [chat[0], {"role": "user", "content": [{"type": "text", "text": "yo"}]}]
    assert await choose(pool, "decode", policy, PickContext("b", messages=chat2)) is first
    assert PickContext("c", messages=chat).text_hashes(256)


async def test_token_prompts_and_batches_score_nothing() -> None:
    assert PickContext("a", prompt_token_ids=[1, 2, 3] * 100).text_hashes(256) == []
