"""Selection policies, table-driven: given in-flight counts and a request sequence, which
endpoints get picked."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from router.errors import NoEndpointAvailable
from router.metrics import RouterMetrics
from router.policies import POLICIES, PickContext, build_policy, choose
from router.pool import EndpointPool

CTX = PickContext("rid")


def make_pool(n: int) -> EndpointPool:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(n)]
    return EndpointPool(urls, urls, RouterMetrics.create(CollectorRegistry()))


CASES = [
    # (policy, number of engines, in-flight per engine, unhealthy indexes, picks expected)
    ("round-robin", 3, [0, 0, 0], [], [0, 1, 2, 0, 1]),
    ("round-robin", 3, [5, 0, 9], [], [0, 1, 2, 0]),  # load is ignored
    ("round-robin", 3, [0, 0, 0], [1], [0, 2, 0, 2]),  # unhealthy skipped
    ("round-robin", 1, [0], [], [0, 0, 0]),
    ("least-inflight", 3, [2, 0, 1], [], [1, 1, 1]),
    ("least-inflight", 3, [0, 0, 0], [], [0, 1, 2, 0]),  # ties rotate
    ("least-inflight", 3, [3, 1, 1], [], [1, 2, 1, 2]),
    ("least-inflight", 3, [3, 0, 1], [1], [2, 2]),  # the least loaded is down
    ("least-inflight", 2, [4, 4], [], [0, 1, 0]),
]


@pytest.mark.parametrize(("name", "n", "loads", "down", "expected"), CASES)
async def test_policy_picks(
    name: str, n: int, loads: list[int], down: list[int], expected: list[int]
) -> None:
    pool = make_pool(n)
    eps = pool.endpoints("decode")
    for ep, load in zip(eps, loads, strict=True):
        ep.in_flight = load
    for i in down:
        eps[i].set_healthy(False)
    policy = build_policy(name)
    picks = [(await choose(pool, "decode", policy, CTX)).index for _ in expected]
    assert picks == expected


async def test_least_inflight_follows_tracked_load() -> None:
    pool = make_pool(2)
    policy = build_policy("least-inflight")
    first = await choose(pool, "prefill", policy, CTX)
    with pool.track(first):
        second = await choose(pool, "prefill", policy, CTX)
        assert second is not first
        with pool.track(second), pool.track(second):
            assert await choose(pool, "prefill", policy, CTX) is first
    assert first.in_flight == 0 and second.in_flight == 0


async def test_choose_excludes_tried_and_raises_when_none_left() -> None:
    pool = make_pool(2)
    policy = build_policy("round-robin")
    a = await choose(pool, "prefill", policy, CTX)
    b = await choose(pool, "prefill", policy, CTX, exclude=(a,))
    assert b is not a
    with pytest.raises(NoEndpointAvailable):
        await choose(pool, "prefill", policy, CTX, exclude=(a, b))
    for ep in pool.endpoints("prefill"):
        ep.set_healthy(False)
    with pytest.raises(NoEndpointAvailable) as info:
        await choose(pool, "prefill", policy, CTX)
    assert info.value.status == 503


def test_registry_lists_builtins_and_rejects_unknown() -> None:
    assert set(POLICIES) == {"round-robin", "least-inflight"}
    assert all(POLICIES[name].type == name for name in POLICIES)
    with pytest.raises(KeyError, match="least-inflight"):
        build_policy("random")
    with pytest.raises(TypeError):
        POLICIES["x"] = POLICIES["round-robin"]  # type: ignore[index]


def test_track_releases_on_error() -> None:
    pool = make_pool(1)
    ep = pool.endpoints("decode")[0]
    with pytest.raises(RuntimeError), pool.track(ep):
        assert ep.in_flight == 1
        raise RuntimeError("boom")
    assert ep.in_flight == 0
