"""Request priority: read from the body, the header and the client key; bounded by the
key; refused when malformed; forwarded on both legs only where configured."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from pdgate.router.config import ClientKey, RouterConfig
from pdgate.router.errors import InvalidRequest
from pdgate.router.priority import PRIORITY_HEADER, ClientKeys, KeySettings, request_priority
from tests.router.conftest import MODEL
from tests.router.test_access_tokens import access_lines
from tests.router.test_errors import COMPLETIONS, MakeEngine, StartRouter
from tests.router.test_ops import eventually

GOLD = KeySettings("gold", priority=-2)
BULK = KeySettings("bulk", priority=3)


@pytest.mark.parametrize(("body", "header", "key", "expected"), [
    ({}, None, None, 0),  # nothing asked, no key: vLLM's default
    ({"priority": 4}, None, None, 4),
    ({}, "4", None, 4),
    ({}, " -0 ", None, 0),
    ({"priority": 2}, "7", None, 2),  # the body wins over the header
    ({"priority": -5}, None, None, 0),  # without a mapped key: never earlier than 0
    ({}, "-5", None, 0),
    ({}, None, GOLD, -2),  # the key's priority when none is asked
    ({"priority": -9}, None, GOLD, -2),  # ... and the earliest its requests may ask
    ({"priority": 5}, None, GOLD, 5),  # later is always allowed
    ({}, "-1", BULK, 3),
    ({"priority": 2**31 - 1}, None, BULK, 2**31 - 1),
])
def test_effective_priority(body: dict[str, Any], header: str | None,
                            key: KeySettings | None, expected: int) -> None:
    assert request_priority(body, header, key) == expected


@pytest.mark.parametrize(("body", "header"), [
    ({"priority": "high"}, None),
    ({"priority": 1.5}, None),
    ({"priority": True}, None),
    ({"priority": None}, None),
    ({"priority": 2**31}, None),
    ({"priority": -(2**31) - 1}, None),
    ({}, "high"),
    ({}, ""),
    ({}, "1e3"),
    ({}, "99999999999"),
])
def test_malformed_priority_is_invalid(body: dict[str, Any], header: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        request_priority(body, header, None)
    assert info.value.param == "priority"


def test_keys_are_found_by_bearer_credential_and_named() -> None:
    config = RouterConfig(model="m", api_key="plain-key-0", api_keys=["plain-key-1"],
                          client_keys=[ClientKey(key="gold-key-0", name="gold", priority=-1,
                                                 tokens_per_minute=100)])
    keys = ClientKeys(config)

    def of(auth: bytes | None) -> KeySettings | None:
        headers = [] if auth is None else [(b"authorization", auth)]
        return keys.of({"type": "http", "headers": headers})

    assert of(b"Bearer gold-key-0") == KeySettings("gold", -1, 100)
    assert of(b"bearer  plain-key-1 ") == KeySettings("api_keys[0]")
    assert of(b"Bearer plain-key-0") == KeySettings("api_key")
    assert of(b"Bearer other") is None and of(None) is None
    assert of(b"Basic Z29sZC1rZXktMA==") is None  # only Bearer reaches /v1/


# ---- through the router (fake engines on loopback) ----

BODY = {"model": MODEL, "prompt": "Hello world", "max_tokens": 3}


async def _pair(make_engine: MakeEngine, start_router: StartRouter, mode: str,
                **kw: Any) -> tuple[Any, Any, Any]:
    p = await make_engine(engine_id="P0")
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode=mode, kv_ready_timeout_s=10.0, **kw)
    return p, d, router


@pytest.mark.parametrize("mode", ["pull", "notify", "push"])
@pytest.mark.parametrize("stream", [False, True])
async def test_forwarded_priority_is_on_both_legs(
        make_engine: MakeEngine, start_router: StartRouter, mode: str, stream: bool) -> None:
    p, d, router = await _pair(make_engine, start_router, mode, forward_priority=True)
    resp = await router.client.post(COMPLETIONS, json={**BODY, "stream": stream},
                                    headers={PRIORITY_HEADER: "4"})
    assert resp.status_code == 200, resp.text
    assert "Hello world!" in resp.text or "Hello" in resp.text
    assert [r.body["priority"] for r in p.prefills] == [4]
    assert [r.body["priority"] for r in d.decodes] == [4]
    # No priority asked: the legs carry the default (0) explicitly.
    await router.client.post(COMPLETIONS, json=BODY)
    assert p.prefills[-1].body["priority"] == 0 and d.decodes[-1].body["priority"] == 0


async def test_priority_stays_in_the_router_unless_forwarded(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _pair(make_engine, start_router, "pull")
    resp = await router.client.post(COMPLETIONS, json={**BODY, "priority": 6})
    assert resp.status_code == 200, resp.text
    assert "priority" not in p.prefills[0].body and "priority" not in d.decodes[0].body


async def test_a_key_bounds_the_forwarded_priority(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    keys = [ClientKey(key="bulk-key-0", name="bulk", priority=3)]
    p, d, router = await _pair(make_engine, start_router, "pull", forward_priority=True,
                               client_keys=keys)
    auth = {"Authorization": "Bearer bulk-key-0"}
    for asked, sent in ((-7, 3), (9, 9)):
        resp = await router.client.post(COMPLETIONS, json={**BODY, "priority": asked},
                                        headers=auth)
        assert resp.status_code == 200, resp.text
        assert p.prefills[-1].body["priority"] == sent == d.decodes[-1].body["priority"]
    # The key in client_keys is a key the router accepts; others are refused.
    resp = await router.client.post(COMPLETIONS, json=BODY,
                                    headers={"Authorization": "Bearer nope-nope"})
    assert resp.status_code == 401


@pytest.mark.parametrize(("body", "headers", "message"), [
    ({**BODY, "priority": "urgent"}, {}, "priority must be an integer"),
    ({**BODY, "priority": 2**40}, {}, "priority must be in"),
    (BODY, {PRIORITY_HEADER: "soon"}, "X-Request-Priority must be an integer"),
])
async def test_malformed_priority_is_a_400_before_any_engine(
        make_engine: MakeEngine, start_router: StartRouter, body: dict[str, Any],
        headers: dict[str, str], message: str) -> None:
    p, d, router = await _pair(make_engine, start_router, "pull", forward_priority=True)
    resp = await router.client.post(COMPLETIONS, json=body, headers=headers)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == "priority"
    assert err["message"].startswith(message)
    assert p.requests == [] and d.requests == []
    assert router.metric("pdgate_admission_active") == 0


async def test_the_access_line_names_the_key_and_priority_never_the_key_itself(
        make_engine: MakeEngine, start_router: StartRouter,
        caplog: pytest.LogCaptureFixture) -> None:
    keys = [ClientKey(key="bulk-key-0", name="bulk", priority=3)]
    p, d, router = await _pair(make_engine, start_router, "pull", client_keys=keys)
    with caplog.at_level(logging.DEBUG):
        resp = await router.client.post(COMPLETIONS, json=BODY, headers={
            "Authorization": "Bearer bulk-key-0", PRIORITY_HEADER: "5"})
    assert resp.status_code == 200, resp.text
    [line] = access_lines(caplog)
    assert (line["client_key"], line["priority"]) == ("bulk", 5)
    assert "bulk-key-0" not in caplog.text


@pytest.mark.parametrize(("order", "expected"), [
    ("fair", ["f0", "f1", "i0", "f2", "f3"]),
    ("fifo", ["f0", "f1", "f2", "f3", "i0"]),
])
async def test_the_router_queues_by_key_in_the_fair_order(
        make_engine: MakeEngine, start_router: StartRouter, order: str,
        expected: list[str]) -> None:
    # One slot: f0 runs, f1-f3 (flood key) queue, then i0 (another key, same priority).
    keys = [ClientKey(key="flood-key-0", name="flood"), ClientKey(key="inter-key-0",
                                                                name="interactive")]
    p = await make_engine()
    d = await make_engine(delay_s=0.2)
    router = await start_router([p], [d], client_keys=keys, max_concurrent_requests=1,
                                admission_order=order, queue_timeout_s=30)
    sends = []
    for n, name in enumerate(["f0", "f1", "f2", "f3", "i0"]):
        key = "inter-key-0" if name.startswith("i") else "flood-key-0"
        sends.append(asyncio.create_task(router.client.post(
            COMPLETIONS, json={**BODY, "prompt": name},
            headers={"Authorization": f"Bearer {key}"})))
        await eventually(lambda n=n: router.metric("pdgate_admission_queued") == n,
                         f"{name} in")
    for resp in await asyncio.gather(*sends):
        assert resp.status_code == 200, resp.text
    assert [r.body["prompt"] for r in d.decodes] == expected


async def test_a_reserved_slot_lets_a_light_key_start_while_a_flood_queues(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    # Two slots, one reserved: f0 runs, f1 and f2 (flood key) queue, i0 (another key)
    # starts at once beside f0, before f1 (without the reserved slot f1 would have taken
    # the second slot and i0 waited for f0 to end).
    keys = [ClientKey(key="flood-key-0", name="flood"), ClientKey(key="inter-key-0",
                                                                name="interactive")]
    p = await make_engine()
    d = await make_engine(delay_s=0.3)
    router = await start_router([p], [d], client_keys=keys, max_concurrent_requests=2,
                                reserved_slots=1, queue_timeout_s=30)
    sends = []
    for n, name in enumerate(["f0", "f1", "f2"]):
        sends.append(asyncio.create_task(router.client.post(
            COMPLETIONS, json={**BODY, "prompt": name},
            headers={"Authorization": "Bearer flood-key-0"})))
        await eventually(lambda n=n: router.metric("pdgate_admission_queued") == n,
                         f"{name} in")
    resp = await router.client.post(COMPLETIONS, json={**BODY, "prompt": "i0"},
                                    headers={"Authorization": "Bearer inter-key-0"})
    assert resp.status_code == 200, resp.text
    for r in await asyncio.gather(*sends):
        assert r.status_code == 200, r.text
    assert [r.body["prompt"] for r in d.decodes] == ["f0", "i0", "f1", "f2"]
