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

from pdgate.contract.kv_contract import PushDecodeParams, PushPrefillParams
from pdgate.router.flows.bodies import decode_leg_body, prefill_leg_body, remote_prefill
from tests.e2e.cluster import metric, start_cluster, wait_pools_full

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
        shed = metric(c.prefill[0], "pdgate_shim_kv_pushes_shed_total")
        print(f"\nPUSH OVERLOAD {REQUESTS} streams in {took:.1f} s, {shed:.0f} prompts shed")
        wait_pools_full(c)  # and nothing is left held
    finally:
        c.stop()


def _ids(seed: int) -> list[int]:
    """A 300-token prompt as token ids: 19 blocks of 16 on P."""
    return [10 + (seed * 31 + k * 7) % 200 for k in range(300)]


def test_a_prompt_nobody_registered_for_is_shed_when_a_registered_one_waits_for_blocks(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The circular wait, set up leg by leg on the engines themselves (1P1D, 32 blocks
    each: P holds one 300-token prompt at a time): P computes prompt A, whose D leg has not
    come; D registers its blocks for prompt B, whose P leg then waits for the blocks A holds.
    P gives A up (counted), computes B and writes it into D, which answers B; A's D leg,
    coming last, is refused by P at once and D computes A itself. Both answers equal the
    engine's own, and every block comes back."""
    c = start_cluster(tmp_path, tiny_model_dir, block_size=16, extra=[
        "--pd-mode", "push", "--num-blocks", "32",
        "--engine-arg=--kv-lease-seconds=600", "--engine-arg=--kv-transfer-timeout=600"])
    p_url, d_url = c.prefill[0], c.decode[0]
    a, b = _ids(1), _ids(2)

    def body(ids: list[int]) -> dict[str, object]:
        return {"model": c.model, "prompt": ids, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}

    async def run() -> tuple[dict[str, str], dict[str, str], float]:
        async with httpx.AsyncClient(timeout=120) as client:
            alone = {name: (await client.post(d_url + "/v1/completions", json=body(ids))
                            ).json()["choices"][0]["text"] for name, ids in (("a", a), ("b", b))}
            info = (await client.get(p_url + "/v1/kv/info")).json()

            async def leg(url: str, rid: str, raw: bytes) -> httpx.Response:
                return await client.post(url + "/v1/completions", content=raw, headers={
                    "X-Request-Id": rid, "Content-Type": "application/json"})

            def d_leg(rid: str, ids: list[int]) -> bytes:
                return decode_leg_body(body(ids), remote_prefill(PushDecodeParams(
                    remote_engine_id=info["engine_id"], remote_host=info["host"],
                    remote_port=info["port"], remote_agent_name=info["agent_name"],
                    num_tokens=len(ids), push_deadline=time.time() + 120).to_params()))

            def p_leg(ids: list[int]) -> bytes:
                return prefill_leg_body(body(ids),
                                        PushPrefillParams(num_tokens=len(ids)).to_params())

            r = await leg(p_url, "shed-a", p_leg(a))  # A computed, held for a D leg
            assert r.status_code == 200, r.text
            d_b = asyncio.create_task(leg(d_url, "shed-b", d_leg("shed-b", b)))
            await asyncio.sleep(0.5)  # D's registration for B is at P
            t0 = time.monotonic()
            r = await leg(p_url, "shed-b", p_leg(b))  # waits for A's blocks
            assert r.status_code == 200, r.text
            took = time.monotonic() - t0
            got = {"b": (await d_b).json()["choices"][0]["text"]}
            r = await leg(d_url, "shed-a", d_leg("shed-a", a))
            assert r.status_code == 200, r.text
            got["a"] = r.json()["choices"][0]["text"]
            return alone, got, took

    try:
        alone, got, took = asyncio.run(run())
        assert got == alone
        assert took < 30, f"B's prefill waited {took:.0f} s for A's blocks"
        assert metric(p_url, "pdgate_shim_kv_pushes_shed_total") == 1
        wait_pools_full(c)
    finally:
        c.stop()
