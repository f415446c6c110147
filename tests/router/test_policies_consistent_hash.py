"""`consistent-hash` and `random`, and vllm-router's policy names: a session's engine is a
function of its key and the engine set, so two independently built policies (two router
replicas) agree, and an engine leaving moves only its own sessions."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from pdgate.router.config import PolicySpec
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import PickContext, build_policy, choose
from pdgate.router.pool import EndpointPool

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]


def replica(urls: list[str] = URLS) -> EndpointPool:
    return EndpointPool(urls, urls, RouterMetrics.create(CollectorRegistry()))


async def engine_of(pool: EndpointPool, policy_name: str | PolicySpec, key: str,
                    *, user: bool = False) -> str:
    ctx = PickContext("r", None, {} if user else {"x-session-id": key},
                      key if user else None)
    return (await choose(pool, "decode", build_policy(policy_name), ctx)).url


async def test_two_replicas_agree_on_every_session() -> None:
    a, b = replica(), replica(list(reversed(URLS)))  # another replica, other URL order
    pa, pb = build_policy("consistent-hash"), build_policy("consistent_hash")
    picks = {}
    for i in range(300):
        ctx = PickContext("r", None, {"x-session-id": f"s{i}"})
        ea = (await choose(a, "decode", pa, ctx)).url
        eb = (await choose(b, "decode", pb, ctx)).url
        assert ea == eb, i
        picks[i] = ea
    spread = Counter(picks.values())
    assert set(spread) == set(URLS) and min(spread.values()) > 20  # every engine used
    again = PickContext("r", None, {"x-session-id": "s7"})
    for _ in range(5):
        assert (await choose(a, "decode", pa, again)).url == picks[7]


async def test_the_user_field_keys_too_and_no_key_means_least_loaded() -> None:
    pool = replica()
    assert await engine_of(pool, "consistent-hash", "alice", user=True) == \
        await engine_of(replica(), "consistent-hash", "alice", user=True)
    eps = pool.endpoints("decode")
    for i, ep in enumerate(eps):
        ep.in_flight = 5 if i != 3 else 0
    policy = build_policy("consistent-hash")
    assert (await choose(pool, "decode", policy, PickContext("r"))).url == URLS[3]


async def test_an_engine_leaving_moves_only_its_sessions() -> None:
    pool = replica()
    policy = build_policy("consistent-hash")
    ctxs = [PickContext("r", None, {"x-session-id": f"k{i}"}) for i in range(200)]
    before = [(await choose(pool, "decode", policy, c)).url for c in ctxs]
    gone = pool.endpoints("decode")[2]
    gone.set_healthy(False)
    after = [(await choose(pool, "decode", policy, c)).url for c in ctxs]
    for b, a in zip(before, after, strict=True):
        assert a == b if b != gone.url else a != gone.url


@pytest.mark.parametrize("header", ["x-session-id", "x-user-id"])
async def test_configured_headers(header: str) -> None:
    spec = PolicySpec("consistent-hash", params={"headers": ["x-session-id", "x-user-id"]})
    ctx = PickContext("r", None, {header: "same-key"})
    urls = {(await choose(replica(), "decode", build_policy(spec), ctx)).url
            for _ in range(3)}
    assert len(urls) == 1


async def test_random_uses_every_engine() -> None:
    pool = replica()
    policy = build_policy(PolicySpec("random", params={"seed": 3}))
    seen = Counter([(await choose(pool, "decode", policy, PickContext("r"))).url
                    for _ in range(200)])
    assert set(seen) == set(URLS)


@pytest.mark.parametrize(("alias", "policy_type"), [
    ("cache_aware", "prefix-text"), ("consistent_hash", "consistent-hash"),
    ("random", "random"), ("round_robin", "round-robin"), ("power_of_two", "power-of-two"),
])
def test_vllm_router_names(alias: str, policy_type: str) -> None:
    assert build_policy(alias).type == policy_type
