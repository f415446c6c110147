"""Selection policies, table-driven: given in-flight counts, what engines already hold and a
request sequence, which endpoints get picked."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdgate.router.config import ConfigError, PolicySpec
from pdgate.router.errors import NoEndpointAvailable
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import POLICIES, PickContext, PolicyEnv, build_policy, choose
from pdgate.router.policies.kv_events import KVEventIndex, Stored
from pdgate.router.policies.prefix_index import PrefixIndex, block_hashes
from pdgate.router.pool import EndpointPool

CTX = PickContext("rid")
BS = 4


def make_pool(n: int) -> EndpointPool:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(n)]
    return EndpointPool(urls, urls, RouterMetrics.create(CollectorRegistry()))


def prompt(system: int, user: int = 0, blocks: int = 4) -> list[int]:
    """`blocks` full blocks of a shared system prompt, then one block unique to `user`."""
    return [system * 100 + i for i in range(blocks * BS)] + [10_000 + user] * BS


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
    ("session", 3, [2, 0, 1], [], [1, 1, 1]),  # no session key: least loaded
    ("consistent-hash", 3, [2, 0, 1], [], [1, 1, 1]),  # no key: least loaded
    ("prefix-aware", 3, [2, 0, 1], [], [1, 1, 1]),  # no prompt: least loaded
    ("prefix-text", 3, [2, 0, 1], [], [1, 1, 1]),
    ("kv-events", 2, [0, 0], [], [0, 1, 0]),  # no prompt, idle: rotate
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


POWER_OF_TWO = [
    # (in-flight per engine, indexes that must never be picked)
    ([0, 5, 9], {2}),  # the most loaded never wins a pair
    ([9, 9, 0, 9], set()),  # a pair of two 9s is possible
    ([1, 2, 3, 4], {3}),
    ([0], set()),
]


@pytest.mark.parametrize(("loads", "never"), POWER_OF_TWO)
async def test_power_of_two_never_picks_the_most_loaded(loads: list[int], never: set[int]) -> None:
    pool = make_pool(len(loads))
    for ep, load in zip(pool.endpoints("decode"), loads, strict=True):
        ep.in_flight = load
    policy = build_policy(PolicySpec("power-of-two", params={"seed": 7}))
    picks = {(await choose(pool, "decode", policy, CTX)).index for _ in range(200)}
    assert not picks & never
    if len(loads) > 1:
        assert len(picks) > 1  # it does sample, not always the same engine


SESSION = [
    # (requests as (header value, user), loads before each request, picks expected)
    ([("a", None), ("a", None), ("a", None)], [[0, 0], [5, 0], [9, 0]], [0, 0, 0]),
    ([("a", None), ("b", None), ("a", None), ("b", None)], [[0, 0]] * 4, [0, 1, 0, 1]),
    ([(None, "u1"), (None, "u1"), (None, "u2")], [[0, 0], [3, 0], [3, 0]], [0, 0, 1]),
    ([(None, None), (None, None)], [[0, 4], [0, 4]], [0, 0]),  # no key: least loaded
]


@pytest.mark.parametrize(("requests", "loads", "expected"), SESSION)
async def test_session_affinity(
    requests: list[tuple[str | None, str | None]], loads: list[list[int]], expected: list[int]
) -> None:
    pool = make_pool(2)
    policy = build_policy("session")
    picks = []
    for (header, user), load in zip(requests, loads, strict=True):
        for ep, n in zip(pool.endpoints("decode"), load, strict=True):
            ep.in_flight = n
        headers = {"x-session-id": header} if header else {}
        ctx = PickContext("r", None, headers, user)
        picks.append((await choose(pool, "decode", policy, ctx)).index)
    assert picks == expected


async def test_session_moves_when_its_engine_is_down_and_expires_after_ttl() -> None:
    now = [0.0]
    env = PolicyEnv(clock=lambda: now[0])
    pool = make_pool(2)
    policy = build_policy(PolicySpec("session", params={"ttl_s": 10, "max_sessions": 2}), env)
    ctx = PickContext("r", None, {"x-session-id": "s"})
    first = await choose(pool, "decode", policy, ctx)
    first.set_healthy(False)
    second = await choose(pool, "decode", policy, ctx)
    assert second is not first
    first.set_healthy(True)
    assert await choose(pool, "decode", policy, ctx) is second  # stays where it moved
    now[0] = 100.0  # expired: least loaded again (second busier now)
    second.in_flight = 3
    assert await choose(pool, "decode", policy, ctx) is first
    for key in ("k1", "k2", "k3"):  # bounded: the oldest keys go first
        await choose(pool, "decode", policy, PickContext("r", None, {"x-session-id": key}))
    assert len(policy.policy) <= 2  # type: ignore[arg-type]


PREFIX = [
    # (engine -> prompts it holds, loads, prompt, expected pick)
    ({0: [prompt(1)], 1: [prompt(2)]}, [0, 0], prompt(2, user=5), 1),
    ({0: [prompt(1)], 1: [prompt(2)]}, [0, 0], prompt(1, user=5), 0),
    # longest match wins over a shorter one
    ({0: [prompt(1, blocks=2)], 1: [prompt(1)]}, [0, 0], prompt(1, user=9), 1),
    # a small load difference does not break affinity...
    ({0: [prompt(1)], 1: []}, [3, 0], prompt(1, user=1), 0),
    # ...an imbalance beyond both thresholds does (abs 8, rel 1.5)
    ({0: [prompt(1)], 1: []}, [12, 2], prompt(1, user=1), 1),
    # imbalance needs both: 20 vs 14 is > 8 apart but < 1.5x
    ({0: [prompt(1)], 1: []}, [20, 14], prompt(1, user=1), 0),
    # nothing cached anywhere: least loaded
    ({0: [], 1: []}, [2, 1], prompt(3), 1),
    # nothing matches: the engine with fewer cached blocks (spread) at equal load
    ({0: [prompt(1), prompt(2)], 1: [prompt(4)]}, [0, 0], prompt(3), 1),
]


@pytest.mark.parametrize("name", ["prefix-aware", "kv-events"])
@pytest.mark.parametrize(("holds", "loads", "ids", "expected"), PREFIX)
async def test_prefix_policies_prefer_longest_match_unless_imbalanced(
    name: str, holds: dict[int, list[list[int]]], loads: list[int], ids: list[int],
    expected: int,
) -> None:
    pool = make_pool(2)
    eps = pool.endpoints("decode")
    env = PolicyEnv(block_size=BS, approx=PrefixIndex(10_000))
    for i, prompts in holds.items():
        for p in prompts:
            env.approx.insert(eps[i].url, block_hashes(p, BS))
    for ep, load in zip(eps, loads, strict=True):
        ep.in_flight = load
    policy = build_policy(name, env)
    assert (await choose(pool, "decode", policy, PickContext("r", ids))).index == expected


async def test_kv_events_trusts_events_over_routing_history() -> None:
    pool = make_pool(2)
    e0, e1 = (ep.url for ep in pool.endpoints("decode"))
    exact = KVEventIndex(BS, 10_000)
    env = PolicyEnv(block_size=BS, approx=PrefixIndex(10_000), exact=exact)
    ids = prompt(1)
    env.approx.insert(e0, block_hashes(ids, BS))  # the router *sent* it to e0 once...
    exact.apply(e0, [])  # ...but e0 publishes and reports nothing cached
    exact.apply(e1, [Stored([11, 12], None, ids[: 2 * BS], BS)])  # e1 reports 2 blocks
    kv = build_policy("kv-events", env)
    approx = build_policy("prefix-aware", env)
    assert (await choose(pool, "decode", kv, PickContext("r", ids))).url == e1
    assert (await choose(pool, "decode", approx, PickContext("r", ids))).url == e0


async def test_every_pick_is_recorded_and_hit_metrics_count_blocks() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics.create(registry)
    pool = make_pool(2)
    env = PolicyEnv(block_size=BS, approx=PrefixIndex(10_000))
    policy = build_policy("prefix-aware", env, metrics)
    ids = prompt(1)
    first = await choose(pool, "prefill", policy, PickContext("r", ids))
    again = await choose(pool, "prefill", policy, PickContext("r", ids))
    assert again is first
    lookups = registry.get_sample_value("pdgate_prefix_lookup_blocks_total", {"role": "prefill"})
    hits = registry.get_sample_value("pdgate_prefix_hit_blocks_total", {"role": "prefill"})
    assert (lookups, hits) == (10.0, 5.0)  # 5 blocks each time; the second all cached


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


async def test_choose_avoids_engines_that_failed_the_request_while_others_are_left() -> None:
    pool = make_pool(3)
    policy = build_policy("round-robin")
    eps = pool.endpoints("prefill")
    avoid = PickContext("r", avoid=frozenset({eps[0].url, eps[1].url}))
    assert {(await choose(pool, "prefill", policy, avoid)).url for _ in range(4)} == {
        eps[2].url}
    # Only avoided engines left: one of them rather than none.
    assert await choose(pool, "prefill", policy, avoid, exclude=(eps[2],)) in eps[:2]


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


def test_registry_lists_builtins_and_rejects_unknown() -> None:
    assert set(POLICIES) == {
        "round-robin", "least-inflight", "power-of-two", "random", "session",
        "consistent-hash", "prefix-aware", "prefix-text", "kv-events",
        "load-aware",
    }
    assert all(POLICIES[name].type == name for name in POLICIES)
    with pytest.raises(ConfigError, match="least-inflight"):
        build_policy("randomly")
    with pytest.raises(TypeError):
        POLICIES["x"] = POLICIES["round-robin"]  # type: ignore[index]


BAD_PARAMS = [
    (PolicySpec("prefix-aware", params={"balance_rel_threshold": 0.5}), "balance_rel_threshold"),
    (PolicySpec("prefix-aware", params={"load_wieght": 1}), "load_wieght"),
    (PolicySpec("session", name="sticky", params={"ttl_s": 0}), "ttl_s"),
    (PolicySpec("round-robin", params={"x": 1}), "x"),
    (PolicySpec("power-of-two", params={"seed": "a"}), "seed"),
]


@pytest.mark.parametrize(("spec", "field"), BAD_PARAMS)
def test_bad_params_name_policy_and_field(spec: PolicySpec, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_policy(spec)
    assert field in str(info.value)
    assert repr(spec.name or spec.type) in str(info.value)


def test_track_releases_on_error() -> None:
    pool = make_pool(1)
    ep = pool.endpoints("decode")[0]
    with pytest.raises(RuntimeError), pool.track(ep):
        assert ep.in_flight == 1
        raise RuntimeError("boom")
    assert ep.in_flight == 0
