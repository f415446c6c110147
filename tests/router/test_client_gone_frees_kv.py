"""Notify mode, early first token: a client that leaves after P's KV landed in D's
reservation but before P's reply came (the reply may trail its KV-ready notice) gets D told
to free that reservation at once, not after its TTL."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from tests.router.conftest import MODEL, RunningRouter, until
from tests.router.fake_engine import FAKE_FIRST_TOKEN, FakeEngine

BODY = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "stream": True}


async def test_client_leaving_between_kv_ready_and_p_reply_frees_d_reservation(
        make_engine: Callable[..., Awaitable[FakeEngine]],
        start_router: Callable[..., Awaitable[RunningRouter]]) -> None:
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
