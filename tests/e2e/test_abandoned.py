"""Clients that walk away free every block on both engines within 3 s, in every mode: 200
at once, with and without the early first token, none waiting for a lease or reservation
TTL (P's lease 30 s, D's reservation 60 s).

Per mode one cluster (`--early-first-token` on) serves both kinds of stream: an eligible one
takes the early-first-token path, one with a `stop` list the plain flow (exactly the path of
`--no-early-first-token`: `eligible` is the only gate). Each kind is left after its first
event (with the early token: P's token, while D's continuation is still being opened) and,
like non-streaming requests, at moments spread over the prefill, the KV transfer and the
decode (the early flow's KV-ready wait and its wait for P's reply included)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, metric, pool_states, start_cluster

pytestmark = pytest.mark.slow

PROMPT = "Paged attention stores keys and values in fixed size blocks. " * 12
ABANDONED = 200
# Notify's D keeps a reservation P may be writing into 2 s past its abort (a WRITE posted
# just before may still land) and reaps every 0.5 s; one P never saw is freed at once.
FREED_WITHIN_S = 3.0


@pytest.fixture(scope="module", params=["pull", "notify", "push"])
def cluster(request: pytest.FixtureRequest, tiny_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp(f"abandon-{request.param}"), tiny_model_dir,
                      extra=["--pd-mode", request.param, "--router-arg=--early-first-token"])
    yield c
    c.stop()


def _body(i: int) -> dict[str, Any]:
    """Request `i`: kinds in turn (early stream, plain stream, non-streaming), each prompt
    its own so no prefix cache shortens its prefill."""
    kind = i % 3
    body: dict[str, Any] = {"model": "tiny", "prompt": f"{i} {PROMPT}", "max_tokens": 200,
                            "ignore_eos": True, "stream": kind != 2}
    if kind == 1:
        body["stop"] = ["never in the output"]  # not eligible: the plain flow
    return body


async def _walk_away(client: httpx.AsyncClient, i: int) -> None:
    body = _body(i)
    # Half the streams stay until their first event; every other request leaves at its
    # own moment, spread over the 2 s these 200 take on 2 cores.
    leave_after = 0.02 * (i % 100)
    if body["stream"] and i % 2 == 0:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return  # leaves mid-stream
        return

    async def ask() -> None:
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
        else:
            await client.post("/v1/completions", json=body)

    try:
        await asyncio.wait_for(ask(), leave_after)
    except TimeoutError:
        pass


def _states_at(c: Cluster, limit: float) -> list[tuple[float, float, float]]:
    """Every engine's (free, total, leased) once all are full, else as they are `limit` s
    from now."""
    deadline = time.monotonic() + limit
    while True:
        states = pool_states(c)
        if all(free == total and leased == 0 for free, total, leased in states):
            return states
        if time.monotonic() >= deadline:
            return states
        time.sleep(0.1)


def test_walked_away_requests_free_their_blocks_at_once(cluster: Cluster) -> None:
    async def run() -> None:
        # One connection per client, as 200 separate clients would have.
        limits = httpx.Limits(max_connections=ABANDONED, max_keepalive_connections=ABANDONED)
        async with httpx.AsyncClient(base_url=cluster.router, timeout=60,
                                     limits=limits) as client:
            await asyncio.gather(*(_walk_away(client, i) for i in range(ABANDONED)))

    asyncio.run(run())
    states = _states_at(cluster, FREED_WITHIN_S)
    held = {url: int(total - free) for url, (free, total, _) in
            zip(cluster.prefill + cluster.decode, states, strict=True)}
    leased = sum(s[2] for s in states)
    aborts = {r: metric(cluster.router, "pdgate_kv_aborts_total", f'result="{r}"')
              for r in ("ok", "unsupported", "failed")}
    assert not any(held.values()) and not leased, (
        f"{FREED_WITHIN_S:g} s after {ABANDONED} clients left: blocks held {held}, leased "
        f"{leased:g}; router's KV aborts {aborts}")
    # And the cluster still serves.
    r = httpx.post(cluster.router + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200
