"""The client's `X-Request-Id` never keys engine state: concurrent requests that share an
id, and ids that are very long, start with `pdgate:` or are not ASCII, each get their own
prompt's answer in pull, notify and push modes (real shims, real NIXL), and the block pools
come back full."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Cluster, complete, start_cluster, wait_pools_full

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed size blocks. " * 6,
    "One two three four five six seven eight nine ten eleven twelve",
    "Routers, prefill engines and decode engines talk over HTTP and NIXL. " * 3,
    "zebra",
]
HOSTILE_IDS = {
    "long": "x" * 2000,
    "pdgate-prefix": "pdgate:landed:abc",
    "non-ascii": "r\u00e9q-\u00fc".encode().decode("latin-1"),  # as a client's UTF-8 bytes
}


@pytest.fixture(scope="module", params=["pull", "notify", "push"])
def cluster(request: pytest.FixtureRequest, tiny_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    mode = request.param
    c = start_cluster(tmp_path_factory.mktemp(f"ids-{mode}"), tiny_model_dir,
                      extra=["--pd-mode", mode])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def expected(cluster: Cluster) -> dict[str, str]:
    """Each prompt's greedy answer from the decode engine alone (colocated)."""
    return {p: complete(cluster.decode[0], p)["choices"][0]["text"] for p in PROMPTS}


async def _one(client: httpx.AsyncClient, prompt: str, rid: str, stream: bool) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    headers = {"X-Request-Id": rid.encode("latin-1")}
    if not stream:
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])
    text = ""
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    return text


def test_concurrent_requests_sharing_an_id_get_their_own_answers(
    cluster: Cluster, expected: dict[str, str]
) -> None:
    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=cluster.router, timeout=120) as client:
            jobs = [(PROMPTS[i % len(PROMPTS)], i % 2 == 0) for i in range(24)]
            got = await asyncio.gather(*(_one(client, p, "same-id", s) for p, s in jobs))
            return [(p, g) for (p, _), g in zip(jobs, got, strict=True)]

    for prompt, got in asyncio.run(run()):
        assert got == expected[prompt], prompt
    wait_pools_full(cluster)


@pytest.mark.parametrize("kind", sorted(HOSTILE_IDS))
def test_hostile_client_ids_are_answered_and_echoed_safely(
    cluster: Cluster, expected: dict[str, str], kind: str
) -> None:
    rid = HOSTILE_IDS[kind]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster.router, timeout=120) as client:
            return await asyncio.gather(*(_one(client, PROMPTS[i], rid, i % 2 == 1)
                                          for i in range(4)))

    for i, got in enumerate(asyncio.run(run())):
        assert got == expected[PROMPTS[i]]
    r = httpx.post(cluster.router + "/v1/completions", timeout=60,
                   headers={"X-Request-Id": rid.encode("latin-1")},
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    echoed = r.headers["x-request-id"]
    assert echoed.isascii() and echoed.isprintable() and 0 < len(echoed) <= 128
    wait_pools_full(cluster)
