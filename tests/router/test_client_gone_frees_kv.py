"""A client that leaves at an awkward moment of the early first token frees the KV blocks
its request holds at once, not at an engine's lease or reservation TTL, against fake
engines on loopback:
- notify: after P's KV landed in D's reservation but before P's reply came (the reply may
  trail its KV-ready notice): D is told to free the reservation;
- pull: after P's token reached it, while D's continuation is still opening: P is told to
  free the prompt's blocks nobody will read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from tests.router.conftest import MODEL, RunningRouter, until
from tests.router.fake_engine import FAKE_FIRST_TOKEN, FAKE_PROMPT_IDS, FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
BODY: dict[str, Any] = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4,
                        "stream": True}


async def test_notify_client_leaving_between_kv_ready_and_p_reply_frees_d_reservation(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0", first_token_ids=[FAKE_FIRST_TOKEN],
                          reply_after_notice_s=3.0)
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode="notify", kv_ready_timeout_s=10.0)
    async with httpx.AsyncClient(base_url=router.url) as client:
        try:
            # KV-ready is in at once; P's reply would open the stream 3 s later.
            await client.post("/v1/completions", json=BODY, timeout=0.5)
        except httpx.ReadTimeout:
            pass  # the client walked away
    rid = str(d.reserves[0]["request_id"])
    await until(lambda: rid in d.aborts)
    assert d.decodes == []  # nobody claimed the reservation


async def test_pull_client_leaving_after_p_token_while_d_opens_frees_p_blocks(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0", token_ids=True)
    d = await make_engine(engine_id="D0", delay_s=3.0)  # D's stream opens 3 s late
    router = await start_router([p], [d])
    body = {**BODY, "prompt": list(FAKE_PROMPT_IDS)}
    async with router.client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break  # P's token arrived; the client walks away
    await until(lambda: len(p.aborts) == 1)
    assert p.aborts == [str(p.requests[0].headers["X-Request-Id"])]
