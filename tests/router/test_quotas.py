"""Per-key token quotas: a sliding 60-s window of the tokens the client was relayed, 429
`rate_limit_exceeded` with a truthful Retry-After once it is used up."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pdgate.router.config import ClientKey
from pdgate.router.errors import QuotaExceeded
from pdgate.router.priority import KeySettings
from pdgate.router.quotas import TokenQuotas
from tests.router.conftest import MODEL
from tests.router.test_errors import CHAT, COMPLETIONS, HI, MakeEngine, StartRouter
from tests.router.test_ops import eventually

KEY = KeySettings("team", tokens_per_minute=150)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_window_slides_and_retry_after_says_when_it_is_under_the_quota() -> None:
    clock = Clock()
    quotas = TokenQuotas(clock)
    quotas.check(KEY)  # nothing used yet
    quotas.charge(KEY, 100)  # ended at t=0
    clock.now += 10
    quotas.check(KEY)  # 100 < 150: may start
    quotas.charge(KEY, 100)  # ended at t=10: 200 in the window
    clock.now += 10  # t=20
    with pytest.raises(QuotaExceeded) as info:
        quotas.check(KEY)
    # Under 150 again when the first 100 leave the window, at t=60: 40 s from now.
    assert info.value.retry_after_s == 40
    assert (info.value.status, info.value.code) == (429, "rate_limit_exceeded")
    assert "'team'" in info.value.message and "150 tokens per minute" in info.value.message
    clock.now += 39.5  # t=59.5: still 200
    with pytest.raises(QuotaExceeded) as info:
        quotas.check(KEY)
    assert info.value.retry_after_s == 1  # 0.5 s, rounded up
    clock.now += 0.5  # t=60: the first 100 are out
    quotas.check(KEY)
    assert quotas.used(KEY) == 100
    clock.now += 10  # t=70: all out
    assert quotas.used(KEY) == 0


def test_retry_after_waits_for_as_many_requests_as_it_takes() -> None:
    clock = Clock()
    quotas = TokenQuotas(clock)
    for _ in range(4):  # 4 x 50 at t = 0, 1, 2, 3
        quotas.charge(KEY, 50)
        clock.now += 1
    with pytest.raises(QuotaExceeded) as info:
        quotas.check(KEY)  # 200: two must leave (t=61) to be under 150
    assert info.value.retry_after_s == 61 - 4


def test_keys_without_a_quota_and_requests_without_a_key_are_never_counted() -> None:
    quotas = TokenQuotas(Clock())
    free = KeySettings("free")
    quotas.charge(free, 10**9)
    quotas.charge(None, 10**9)
    quotas.check(free)
    quotas.check(None)
    assert quotas.used(free) == 0


# ---- through the router: accounting against the usage the client received ----

TEAM_KEY = "sk-team-key-1"
AUTH = {"Authorization": f"Bearer {TEAM_KEY}"}


def _usage_of(resp: Any, stream: bool) -> int:
    if not stream:
        usage = resp.json()["usage"]
    else:
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        [usage] = [e["usage"] for e in events if e.get("usage")]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return int(usage["total_tokens"])


async def _router(make_engine: MakeEngine, start_router: StartRouter,
                  tokens_per_minute: int) -> Any:
    p, d = await make_engine(), await make_engine()
    keys = [ClientKey(key=TEAM_KEY, name="team", tokens_per_minute=tokens_per_minute),
            ClientKey(key="sk-other-key-2", name="other", tokens_per_minute=1)]
    return await start_router([p], [d], client_keys=keys)


REQUESTS: list[tuple[str, dict[str, Any], bool]] = [
    (COMPLETIONS, {"model": MODEL, "prompt": "Hello world", "max_tokens": 3}, False),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hello world", "max_tokens": 3, "stream": True,
                   "stream_options": {"include_usage": True}}, True),
    (CHAT, {"model": MODEL, "messages": HI, "stream": True,
            "stream_options": {"include_usage": True}}, True),
]


async def _spend(router: Any) -> int:
    """Send the three requests, return the tokens their usage blocks said."""
    total = 0
    for path, body, stream in REQUESTS:
        resp = await router.client.post(path, json=body, headers=AUTH)
        assert resp.status_code == 200, resp.text
        total += _usage_of(resp, stream)
    return total


@pytest.mark.parametrize("slack", [0, 1])
async def test_quota_counts_exactly_the_usage_the_client_received(
        make_engine: MakeEngine, start_router: StartRouter, slack: int) -> None:
    # Learn what the three requests cost, from their usage blocks, on a roomy quota...
    probe = await _router(make_engine, start_router, 10**6)
    spent = await _spend(probe)
    # ...then give the key exactly that (plus `slack`): the three pass; the window then
    # holds `spent` tokens, which is the quota (refused) or one under it (one more passes).
    router = await _router(make_engine, start_router, spent + slack)
    assert await _spend(router) == spent
    assert router.metric("pdgate_client_tokens_total", {"key": "team"}) == spent
    path, body, _ = REQUESTS[0]
    resp = await router.client.post(path, json=body, headers=AUTH)
    if slack:
        assert resp.status_code == 200, resp.text
        resp = await router.client.post(path, json=body, headers=AUTH)
    assert resp.status_code == 429
    err = resp.json()["error"]
    assert (err["type"], err["code"]) == ("RateLimitError", "rate_limit_exceeded")
    assert "'team'" in err["message"] and TEAM_KEY not in resp.text
    # The first request ended under a few seconds ago: it leaves the window in ~60 s.
    assert 50 <= int(resp.headers["Retry-After"]) <= 60
    assert router.metric("pdgate_admission_rejected_total", {"reason": "quota"}) == 1
    # Another key's window is its own; requests without a quota are not held back.
    assert (await router.client.post(path, json=body, headers={
        "Authorization": "Bearer sk-other-key-2"})).status_code == 200


async def test_a_stream_without_usage_for_the_client_is_counted_all_the_same(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    path, body, _ = REQUESTS[1]
    probe = await _router(make_engine, start_router, 10**6)
    cost = _usage_of(await probe.client.post(path, json=body, headers=AUTH), True)
    router = await _router(make_engine, start_router, cost)
    quiet = {k: v for k, v in body.items() if k != "stream_options"}
    resp = await router.client.post(path, json=quiet, headers=AUTH)
    assert resp.status_code == 200 and '"usage"' not in resp.text  # the client asked none
    resp = await router.client.post(path, json=quiet, headers=AUTH)
    assert resp.status_code == 429  # the router counted the usage D sent it


async def test_a_request_that_queued_while_the_quota_was_spent_is_refused_at_admission(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    # One slot: B queues behind A; A's tokens fill the key's window when A ends, so B,
    # under the quota when it arrived, is refused when its slot comes, before any engine.
    path, body, _ = REQUESTS[0]
    probe = await _router(make_engine, start_router, 10**6)
    cost = _usage_of(await probe.client.post(path, json=body, headers=AUTH), False)
    p, d = await make_engine(), await make_engine(delay_s=0.5)
    keys = [ClientKey(key=TEAM_KEY, name="team", tokens_per_minute=cost)]
    router = await start_router([p], [d], client_keys=keys, max_concurrent_requests=1,
                                queue_timeout_s=30)
    first = asyncio.create_task(router.client.post(path, json=body, headers=AUTH))
    await eventually(lambda: router.metric("pdgate_admission_active") == 1, "A admitted")
    second = asyncio.create_task(router.client.post(path, json=body, headers=AUTH))
    await eventually(lambda: router.metric("pdgate_admission_queued") == 1, "B queued")
    a, b = await asyncio.gather(first, second)
    assert a.status_code == 200 and b.status_code == 429, b.text
    assert b.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(d.decodes) == 1  # B never reached an engine
    assert router.metric("pdgate_admission_active") == 0  # B's slot was given back
