"""Clients that walk away free every block on both engines about as fast as pull does, in
every mode: streams left after the first event, and non-streaming requests whose client
disconnects while the prefill, the KV transfer or the decode is still running."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Cluster, pool_states, start_cluster

pytestmark = pytest.mark.slow

PROMPT = "Paged attention stores keys and values in fixed size blocks. " * 12
# Pull's bound. Notify's D keeps a reservation P may be writing into 2 s past its abort (a
# WRITE posted just before may still land) and reaps every 0.5 s; one P never saw is freed
# at once.
FREED_WITHIN_S = 3.0


@pytest.fixture(scope="module", params=["pull", "notify", "push"])
def cluster(request: pytest.FixtureRequest, tiny_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp(f"abandon-{request.param}"), tiny_model_dir,
                      extra=["--pd-mode", request.param])
    yield c
    c.stop()


async def _walk_away(client: httpx.AsyncClient, i: int) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
            "stream": i % 2 == 0}
    if body["stream"]:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return  # leaves mid-stream
        return
    # Non-streaming: leave at a different moment each time (prefill, transfer, decode).
    try:
        await asyncio.wait_for(client.post("/v1/completions", json=body), 0.05 * i)
    except TimeoutError:
        pass


def _seconds_until_pools_full(c: Cluster, limit: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        states = pool_states(c)
        if all(free == total and leased == 0 for free, total, leased in states):
            return time.monotonic() - t0
        time.sleep(0.1)
    pytest.fail(f"pools not full {limit}s after the clients left: {pool_states(c)}")


def test_walked_away_requests_free_their_blocks_at_once(cluster: Cluster) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=cluster.router, timeout=60) as client:
            await asyncio.gather(*(_walk_away(client, i) for i in range(16)))

    asyncio.run(run())
    _seconds_until_pools_full(cluster, FREED_WITHIN_S)
    # And the cluster still serves.
    r = httpx.post(cluster.router + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200
