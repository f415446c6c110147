"""A real vLLM prefill engine killed (kill -9) under load behind pdgate's router, then
restarted on the same ports.

This module starts its OWN second prefill engine P2 and kills only that one, so the
session's P, D and REF stay untouched (the `z` makes pytest run this file last anyway).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import httpx
import pytest
from openai.types import Completion

from tests.e2e.cluster import metric
from tests.vllm.conftest import ENGINE_START_TIMEOUT_S, VllmCluster
from tests.vllm.processes import Proc, _spawn, start_vllm, vllm_env, wait_ready
from tests.vllm.test_vllm_pd import IGNORE_EOS, acomplete, async_client, unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

P2_CORE = "0"  # with P and REF; D keeps core 1 to itself
MAX_TOKENS = 12
ROUTER_ARGS = [
    "--prefill-policy", "round-robin",
    "--health-interval-s", "1", "--health-timeout-s", "1",
    "--prefill-timeout-s", "60", "--decode-first-byte-timeout-s", "120",
    "--max-retries", "1", "--eject-consecutive-errors", "3", "--breaker-open-s", "2",
]


@pytest.fixture(scope="module")
def p2(vllm_cluster: VllmCluster) -> Iterator[Proc]:
    """A second vLLM prefill engine owned by this module (stopped at its end)."""
    proc = start_vllm(vllm_cluster.python, vllm_cluster.model_dir, "P2",
                      vllm_cluster.log_dir, core=P2_CORE)
    holder = [proc]
    try:
        wait_ready([proc], "/health", ENGINE_START_TIMEOUT_S)
        yield proc
    finally:
        holder[-1].stop()
        proc.stop()


@pytest.fixture(scope="module")
def router(vllm_cluster: VllmCluster, p2: Proc) -> Proc:
    c = vllm_cluster
    return c.start_router("router-zfault", [p2.url, c.p.url], [c.d.url], ROUTER_ARGS)


def _kill_group(proc: Proc) -> None:
    """kill -9 the engine's whole process group (API server, EngineCore, worker)."""
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(timeout=30)


async def _routed(url: str, prompt: str) -> tuple[str, Completion]:
    async with async_client(url) as c:
        raw = await c.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=IGNORE_EOS)
    return raw.headers["x-pdgate-prefill-engine"], raw.parse()


async def _load_with_kill(router: str, prompts: list[str], victim: Proc,
                          kill_after: int) -> list[tuple[str, Completion]]:
    """Send `prompts` 4 at a time; kill `victim` once `kill_after` of them completed."""
    gate = asyncio.Semaphore(4)
    done = asyncio.Event()
    finished = 0

    async def one(prompt: str) -> tuple[str, Completion]:
        nonlocal finished
        async with gate:
            result = await _routed(router, prompt)
        finished += 1
        if finished >= kill_after:
            done.set()
        return result

    async def killer() -> None:
        await done.wait()
        await asyncio.to_thread(_kill_group, victim)

    results, _ = await asyncio.wait_for(
        asyncio.gather(asyncio.gather(*(one(p) for p in prompts)), killer()), timeout=600)
    return list(results)


def _recovered(router: str) -> float:
    return (metric(router, "pdgate_retries_total")
            + metric(router, "pdgate_fallbacks_total"))


async def test_prefill_engine_killed_mid_load(vllm_cluster: VllmCluster, p2: Proc,
                                              router: Proc) -> None:
    c = vllm_cluster
    # Warm up: D has handshaken with P2 and read KV from it before it dies.
    warm = [await _routed(router.url, unique_prompt(30)) for _ in range(2)]
    assert {w[0] for w in warm} == {p2.url, c.p.url}
    before = _recovered(router.url)

    prompts = [unique_prompt(20 + 8 * (i % 4)) for i in range(12)]
    results = await _load_with_kill(router.url, prompts, p2, kill_after=3)
    assert not p2.alive()
    colocated = [await acomplete(c.ref.url, p, MAX_TOKENS) for p in prompts]
    assert [r.choices[0].text for _, r in results] == [x.choices[0].text for x in colocated]
    assert all(r.usage is not None and r.usage.completion_tokens == MAX_TOKENS
               for _, r in results)
    # Some leg met the dead engine and was retried on P (or ran decode-only), counted.
    assert _recovered(router.url) > before, c.logs()

    assert httpx.get(router.url + "/ready", timeout=5).status_code == 200
    after = [await _routed(router.url, unique_prompt(25)) for _ in range(3)]
    assert [a[0] for a in after] == [c.p.url] * 3
