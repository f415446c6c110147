"""Fault injection on a real 2P2D cluster (shim engines, NIXL, router) on loopback.

Each scenario breaks one engine while requests are in flight and checks what a user sees:
every request ends within its deadline (no hang) with a complete answer or a clear error,
no non-streaming request fails while a healthy P/D pair remains, answers stay correct
(greedy output equals the fault-free reference), and after the fault every surviving
engine's KV block pool is entirely free again. The broken engine is then restarted on the
same ports (a new NIXL agent) and must serve again.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.chaos.cluster import (
    LEASE_S,
    ChaosCluster,
    Engine,
    pools_full,
    start_chaos_cluster,
    wait_healthy,
    wait_router_pairs,
)
from tests.e2e.cluster import metric

pytestmark = pytest.mark.slow

PROMPTS = [f"Request number {i} asks the tiny model something." for i in range(8)]
CLIENT_DEADLINE_S = 30.0  # every request must end well within this


@dataclass
class Outcome:
    """What one client saw."""

    status: int
    text: str
    prefill: str | None
    decode: str | None
    error: str | None  # an SSE error event's message, or a non-200 body
    seconds: float


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ChaosCluster]:
    c = start_chaos_cluster(tmp_path_factory.mktemp("chaos"), tiny_model_dir)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def all_engines_up(cluster: ChaosCluster) -> None:
    cluster.revive()


@pytest.fixture(scope="module")
def reference(cluster: ChaosCluster) -> dict[str, str]:
    """Fault-free greedy answers, one per prompt."""
    return {p: asyncio.run(_one(cluster, p, stream=False)).text for p in PROMPTS}


def _body(cluster: ChaosCluster, prompt: str, stream: bool, max_tokens: int) -> dict[str, object]:
    return {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def _one(cluster: ChaosCluster, prompt: str, *, stream: bool, max_tokens: int = 8,
               on_first_byte: Callable[[Outcome], None] | None = None) -> Outcome:
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=CLIENT_DEADLINE_S) as client:
        async with client.stream("POST", cluster.url + "/v1/completions",
                                 json=_body(cluster, prompt, stream, max_tokens)) as resp:
            out = Outcome(resp.status_code, "", resp.headers.get("x-pdgate-prefill-engine"),
                          resp.headers.get("x-pdgate-decode-engine"), None, 0.0)
            raw = b""
            async for chunk in resp.aiter_bytes():
                if on_first_byte is not None and not raw:
                    on_first_byte(out)
                raw += chunk
    out.seconds = time.monotonic() - t0
    _parse(out, raw, stream)
    return out


def _parse(out: Outcome, raw: bytes, stream: bool) -> None:
    if out.status != 200:
        out.error = raw.decode(errors="replace")
        return
    if not stream:
        out.text = json.loads(raw)["choices"][0]["text"]
        return
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {raw[-200:]!r}"
    for event in events[:-1]:
        obj = json.loads(event)
        if "error" in obj:
            out.error = obj["error"]["message"]
        else:
            out.text += "".join(c.get("text", "") for c in obj.get("choices", []))


async def _load(cluster: ChaosCluster, n: int, concurrency: int, *, stream: bool = False,
                max_tokens: int = 8, fault: Callable[[int], Awaitable[None]] | None = None,
                on_first_byte: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """`n` requests, `concurrency` at a time; `fault(done_count)` runs beside them."""
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def run(i: int) -> Outcome:
        nonlocal done
        async with sem:
            out = await _one(cluster, PROMPTS[i % len(PROMPTS)], stream=stream,
                             max_tokens=max_tokens, on_first_byte=on_first_byte)
        done += 1
        return out

    tasks = [asyncio.create_task(run(i)) for i in range(n)]
    if fault is not None:
        while done < n // 4:
            await asyncio.sleep(0.01)
        await fault(done)
    return list(await asyncio.gather(*tasks))


def _check_all_complete(outcomes: list[Outcome], reference: dict[str, str], n: int) -> None:
    assert len(outcomes) == n
    for i, out in enumerate(outcomes):
        assert out.status == 200 and out.error is None, out
        assert out.text == reference[PROMPTS[i % len(PROMPTS)]], out
        assert out.seconds < CLIENT_DEADLINE_S


def _restart_and_check(cluster: ChaosCluster, engine: Engine, reference: dict[str, str]) -> None:
    """Bring `engine` back on its ports (new process, new NIXL agent); the router must take
    it back, answers must stay right, and every pool must come back to full."""
    engine.stop()
    engine.start()
    wait_healthy(engine, 120)
    wait_router_pairs(cluster, 2, 2)
    outs = asyncio.run(_load(cluster, 16, 4))
    _check_all_complete(outs, reference, 16)
    leg = engine.role
    served = {o.prefill if leg == "prefill" else o.decode for o in outs}
    assert engine.url in served, f"restarted {engine.name} got no traffic: {served}"
    states = pools_full(cluster.engines, 4 * LEASE_S)
    assert all(f == t and leased == 0 for f, t, leased in states), states


def test_kill_prefill_engine_under_load(cluster: ChaosCluster, reference: dict[str, str]) -> None:
    victim = cluster.by_role("prefill")[0]

    async def kill(_: int) -> None:
        victim.signal(signal.SIGKILL)

    retries = metric(cluster.url, "pdgate_retries_total", 'role="prefill"')
    outs = asyncio.run(_load(cluster, 48, 8, fault=kill))
    _check_all_complete(outs, reference, 48)  # the other P took over: nothing failed
    assert victim.url in {o.prefill for o in outs}  # it was serving when it died
    print("prefill retries:", metric(cluster.url, "pdgate_retries_total", 'role="prefill"')
          - retries)
    survivors = [e for e in cluster.engines if e is not victim]
    states = pools_full(survivors, 4 * LEASE_S)
    assert all(f == t and leased == 0 for f, t, leased in states), states
    _restart_and_check(cluster, victim, reference)


def test_kill_decode_engine_mid_stream(cluster: ChaosCluster, reference: dict[str, str]) -> None:
    victim = cluster.by_role("decode")[0]
    killed: list[bool] = []

    def kill_when_streaming_from_victim(out: Outcome) -> None:
        if out.decode == victim.url and not killed:
            killed.append(True)
            victim.signal(signal.SIGKILL)

    async def scenario() -> tuple[list[Outcome], list[Outcome]]:
        streams = asyncio.create_task(_load(
            cluster, 12, 6, stream=True, max_tokens=200,
            on_first_byte=kill_when_streaming_from_victim))
        plain = asyncio.create_task(_load(cluster, 24, 4))
        return await streams, await plain

    streams, plain = asyncio.run(scenario())
    assert killed, "no stream was served by the victim"
    _check_all_complete(plain, reference, 24)  # non-streaming: retried on the other D
    for out in streams:
        assert out.status == 200 and out.seconds < CLIENT_DEADLINE_S
        if out.error is None:
            continue
        # Cut off after the first byte: a clear error event, on the victim's streams only.
        assert out.decode == victim.url and victim.url in out.error, out
    assert any(o.error for o in streams), "the killed engine's stream should report an error"
    print("stream errors:", sum(1 for o in streams if o.error), "of", len(streams),
          "decode retries:", metric(cluster.url, "pdgate_retries_total", 'role="decode"'))
    survivors = [e for e in cluster.engines if e is not victim]
    states = pools_full(survivors, 4 * LEASE_S)
    assert all(f == t and leased == 0 for f, t, leased in states), states
    _restart_and_check(cluster, victim, reference)


def test_frozen_prefill_engine(cluster: ChaosCluster, reference: dict[str, str]) -> None:
    victim = cluster.by_role("prefill")[1]

    async def freeze(_: int) -> None:
        victim.signal(signal.SIGSTOP)

    retries = metric(cluster.url, "pdgate_retries_total", 'role="prefill"')
    try:
        outs = asyncio.run(_load(cluster, 48, 8, fault=freeze))
    finally:
        victim.signal(signal.SIGCONT)
    _check_all_complete(outs, reference, 48)  # stalled prefills timed out, went elsewhere
    assert victim.url in {o.prefill for o in outs}
    retried = metric(cluster.url, "pdgate_retries_total", 'role="prefill"') - retries
    print("prefill retries:", retried, "slowest:", max(o.seconds for o in outs))
    wait_router_pairs(cluster, 2, 2)  # thawed, it passes health checks again
    # Whatever it pinned while frozen (nobody will read it) goes back by abort or lease.
    states = pools_full(cluster.engines, 4 * LEASE_S)
    assert all(f == t and leased == 0 for f, t, leased in states), states
    outs = asyncio.run(_load(cluster, 16, 4))
    _check_all_complete(outs, reference, 16)
