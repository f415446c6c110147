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
from tests.vllm.processes import Proc, restart, start_vllm, wait_ready
from tests.vllm.test_vllm_pd import (
    IGNORE_EOS,
    acomplete,
    async_client,
    kv_sources,
    unique_prompt,
)

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
def p2_runs(vllm_cluster: VllmCluster) -> Iterator[list[Proc]]:
    """This module's second vLLM prefill engine: every run of it, the live one last
    (a restart appends). All are stopped at the module's end."""
    runs = [start_vllm(vllm_cluster.python, vllm_cluster.model_dir, "P2",
                       vllm_cluster.log_dir, core=P2_CORE)]
    try:
        wait_ready(runs, "/health", ENGINE_START_TIMEOUT_S)
        yield runs
    finally:
        for proc in runs:
            proc.stop()


@pytest.fixture(scope="module")
def p2(p2_runs: list[Proc]) -> Proc:
    return p2_runs[0]


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


async def _holds_nothing(engine: Proc, within_s: float = 30.0, *, blocks: bool = True) -> None:
    """`engine`'s own metrics come back to no request running or waiting and (`blocks`) no
    KV block in use: what the legs cut off by a kill held is freed, not leaked."""
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
    names += ["vllm:kv_cache_usage_perc"] if blocks else []
    held: dict[str, float] = {}
    for _ in range(int(within_s * 2)):
        held = {name: metric(engine.url, name) for name in names}
        if not any(held.values()):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"{engine.name} still holds {held} after {within_s} s")


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
    await _holds_nothing(c.d)

    assert httpx.get(router.url + "/ready", timeout=5).status_code == 200
    after = [await _routed(router.url, unique_prompt(25)) for _ in range(3)]
    assert [a[0] for a in after] == [c.p.url] * 3


async def test_killed_prefill_engine_restarts_on_same_ports(
        vllm_cluster: VllmCluster, p2_runs: list[Proc], router: Proc) -> None:
    """The router takes the restarted engine back (health checks, breaker half-open) and
    D reads KV from its new NIXL agent (a new handshake on the same side-channel port)."""
    c = vllm_cluster
    dead = p2_runs[-1]
    if dead.alive():  # run alone: kill it here
        _kill_group(dead)
    p2_runs.append(restart(dead, c.log_dir))  # same ports, a fresh NIXL agent
    wait_ready(p2_runs[-1:], "/health", ENGINE_START_TIMEOUT_S)
    served: list[str] = []
    external0, local0 = kv_sources(c.d.url)
    prompt_tokens = 0
    for _ in range(20):  # the router notices within a health interval or two
        prompt = unique_prompt(30)
        engine, done = await _routed(router.url, prompt)
        served.append(engine)
        assert done.usage is not None
        prompt_tokens += done.usage.prompt_tokens
        assert done.choices[0].text == (await acomplete(c.ref.url, prompt, MAX_TOKENS)
                                        ).choices[0].text
        if served.count(dead.url) >= 2:
            break
        await asyncio.sleep(0.5)
    assert served.count(dead.url) >= 2, served
    external1, local1 = kv_sources(c.d.url)
    assert external1 - external0 == prompt_tokens  # every prompt's KV read, none recomputed
    assert local1 == local0
