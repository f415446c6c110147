"""Push mode with both engines' KV pools full: every request is answered, none waits for a
timeout.

Both legs of a push start together and each engine admits in its own order. With pools
that hold one request each, D's blocks end up registered for prompts P has not computed,
while P's blocks hold computed prompts whose D legs wait for D's blocks, behind legs the
router had already closed: each engine waits for the other. Before the fix that wait
lasted until P's lease and D's push deadline ran out (40 streams: p50 62 s with 30 s
timeouts, one 502; this test failed). Now a queued request whose connection closed leaves
the shim's admission queue at once (engine_shim/server.py), and P gives up a computed
prompt nobody registered for once a request of its own has waited 0.5 s for blocks (its D
computes the prompt; engine_shim/push.py `shed`; with clients walking away,
tests/e2e/test_abandoned.py's push run took 31 s without it and 13 s with it). The
timeouts here are 600 s, so a request that waited one out cannot be answered within the
test's bound of 120 s."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import start_cluster, wait_pools_full

pytestmark = pytest.mark.slow

REQUESTS = 40
BOUND_S = 120.0  # a fifth of the timeouts: 17-25 s here on 2 cores with the fix


WORDS = "the of and to in is for with at by from are one time over world".split()


def _prompt(i: int) -> str:
    """~300 tokens of the tiny tokenizer (a word each), its own per request."""
    return f"{i} " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(300))


def test_full_pools_in_push_mode_serve_every_request_without_waiting_out_a_timeout(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    c = start_cluster(tmp_path, tiny_model_dir, block_size=16, extra=[
        "--pd-mode", "push", "--num-blocks", "48",  # 768 tokens: one request at a time
        "--router-arg=--early-first-token", "--router-arg=--kv-ready-timeout-s=600",
        "--engine-arg=--kv-lease-seconds=600", "--engine-arg=--kv-transfer-timeout=600"])
    try:
        async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
            """(status, completion tokens in the usage chunk) of one stream."""
            body = {"model": c.model, "prompt": _prompt(i), "max_tokens": 100,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            tokens = 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return r.status_code, tokens

        async def run() -> list[tuple[int, int]]:
            async with httpx.AsyncClient(base_url=c.router, timeout=BOUND_S + 90) as client:
                return await asyncio.gather(*(one(client, i) for i in range(REQUESTS)))

        t0 = time.monotonic()
        answers = asyncio.run(run())
        took = time.monotonic() - t0
        assert [s for s, _ in answers] == [200] * REQUESTS
        assert all(n == 100 for _, n in answers), answers  # every token generated
        assert took < BOUND_S, f"{REQUESTS} streams took {took:.0f} s: a timeout was waited out"
        wait_pools_full(c)  # and nothing is left held
    finally:
        c.stop()
