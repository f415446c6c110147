"""Mid-stream migration with real vLLM 0.32 (pull, NixlConnector): a decode engine killed
(kill -9) while it streams, or while it generates a non-streaming answer
(`--migrate-non-streaming`); the router continues the request on the other decode engine
with P's KV of the prompt plus the generated tokens.

This module starts its OWN second decode engine D2 and kills only that one (the session's
P, D and REF stay untouched; the `z` makes pytest run this file late), restarting it on
the same port for the next test. Its router has P, and D2 and D round-robin, so a request
lands on D2 within two tries.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import metric
from tests.vllm.conftest import ENGINE_START_TIMEOUT_S, VllmCluster
from tests.vllm.processes import (
    BLOCK_SIZE,
    ENGINE_KEY,
    SERVED_NAME,
    Proc,
    restart,
    start_vllm,
    wait_ready,
)
from tests.vllm.test_vllm_pd import IGNORE_EOS, complete, kv_sources, unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

D2_CORE = "0"  # with P and REF; D keeps core 1
MAX_TOKENS = 48
KILL_AFTER = 12  # content chunks the client has before D2 dies
ROUTER_ARGS = [
    "--decode-policy", "round-robin",
    "--health-interval-s", "1", "--health-timeout-s", "1",
    "--prefill-timeout-s", "120", "--decode-first-byte-timeout-s", "180",
    "--decode-idle-timeout-s", "120", "--max-retries", "1", "--migrate-non-streaming",
]
GENERATED = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
def d2(vllm_cluster: VllmCluster) -> Iterator[Proc]:
    c = vllm_cluster
    proc = start_vllm(c.python, c.model_dir, "D2", c.log_dir, core=D2_CORE)
    try:
        wait_ready([proc], "/health", ENGINE_START_TIMEOUT_S)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def router(vllm_cluster: VllmCluster, d2: Proc) -> Proc:
    c = vllm_cluster
    return c.start_router("router-migration", [c.p.url], [d2.url, c.d.url], ROUTER_ARGS)


def _kill_group(proc: Proc) -> None:
    """kill -9 the engine's whole process group (API server, EngineCore, worker)."""
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(timeout=30)


async def _stream(router: str, prompt: str, victim: Proc | None) -> tuple[str, dict, str]:
    """A greedy stream through `router`: its text, its usage, the decode engine its
    headers name. When `victim` serves it, `victim` is killed after KILL_AFTER chunks."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **IGNORE_EOS}
    text, usage, chunks = "", {}, 0
    headers = {"Authorization": f"Bearer {ENGINE_KEY}"}
    async with httpx.AsyncClient(timeout=600, headers=headers) as client, \
            client.stream("POST", router + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        decode = r.headers["x-pdgate-decode-engine"]
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                assert "token_ids" not in choice
                text += choice["text"]
                chunks += bool(choice["text"])
            usage = event.get("usage") or usage
            if victim is not None and decode == victim.url and chunks == KILL_AFTER:
                await asyncio.to_thread(_kill_group, victim)
    return text, usage, decode


async def test_decode_engine_killed_mid_stream_is_migrated_with_kv(
        vllm_cluster: VllmCluster, d2: Proc, router: Proc) -> None:
    c = vllm_cluster
    # Warm up both decode engines (handshakes with P) without a kill.
    for _ in range(2):
        await _stream(router.url, unique_prompt(20), None)
    external0, local0 = kv_sources(c.d.url)
    prompt = ""
    for _ in range(2):  # round-robin: one of two streams lands on D2
        prompt = unique_prompt(40)
        text, usage, decode = await _stream(router.url, prompt, d2)
        if decode == d2.url:
            break
    assert decode == d2.url and not d2.alive(), "no stream was served by D2"
    colocated = complete(c.ref.url, prompt, MAX_TOKENS)
    assert text == colocated.choices[0].text
    assert colocated.usage is not None
    assert usage == {"prompt_tokens": colocated.usage.prompt_tokens,
                     "completion_tokens": MAX_TOKENS,
                     "total_tokens": colocated.usage.prompt_tokens + MAX_TOKENS}
    assert metric(router.url, "pdgate_migrations_total", 'mode="pull",result="kv"') == 1
    # D loaded the continued prefix (the prompt plus at least the tokens the client had)
    # over NIXL and computed only the tail.
    external1, local1 = kv_sources(c.d.url)
    print(f"\nMIGRATION vllm: D external_kv_transfer +{external1 - external0}, "
          f"local_compute +{local1 - local0}, prompt {colocated.usage.prompt_tokens}, "
          f"kill after {KILL_AFTER} chunks")
    assert external1 - external0 >= colocated.usage.prompt_tokens + KILL_AFTER - 1
    assert local1 - local0 <= BLOCK_SIZE  # at most a block's worth: the tail


def _router_sees(router: str, decode: int, timeout: float = 60.0) -> None:
    """Until the router counts `decode` healthy decode engines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(router + "/ready", timeout=5).json().get("decode_healthy") == decode:
            return
        time.sleep(0.5)
    raise AssertionError(f"the router never saw {decode} decode engines")


def _post(url: str, prompt: str) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, **IGNORE_EOS}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600,
                   headers={"Authorization": f"Bearer {ENGINE_KEY}"})
    assert r.status_code == 200, r.text
    return r


def _answer(router: str, prompt: str) -> tuple[str, dict[str, Any], str]:
    """A greedy non-streaming completion through `router`: its text, the whole answer and
    the decode engine its headers name."""
    r = _post(router, prompt)
    choice = r.json()["choices"][0]
    assert choice.get("token_ids") is None
    return choice["text"], r.json(), r.headers["x-pdgate-decode-engine"]


async def _kill_when_generating(victim: Proc, tokens: int, killed: list[float]) -> None:
    """kill -9 `victim` once it generated `tokens` more tokens (vLLM counts every step)."""
    base = await asyncio.to_thread(metric, victim.url, GENERATED)
    while True:
        now = await asyncio.to_thread(metric, victim.url, GENERATED)
        if now - base >= tokens:
            await asyncio.to_thread(_kill_group, victim)
            killed.append(now - base)
            return
        await asyncio.sleep(0.02)


async def test_decode_engine_killed_mid_generation_of_a_non_streaming_request(
        vllm_cluster: VllmCluster, d2: Proc, router: Proc) -> None:
    c = vllm_cluster
    victim = d2 if d2.alive() else restart(d2, c.log_dir)
    try:
        wait_ready([victim], "/health", ENGINE_START_TIMEOUT_S)
        _router_sees(router.url, 2)
        for _ in range(2):  # the (restarted) D2 handshakes with P, without a kill
            _answer(router.url, unique_prompt(20))
        migrated0 = metric(router.url, "pdgate_migrations_total", 'mode="pull",result="kv"')
        external0, local0 = kv_sources(c.d.url)
        killed: list[float] = []
        for _ in range(2):  # round-robin: one of two requests lands on D2
            prompt = unique_prompt(40)
            killer = asyncio.create_task(_kill_when_generating(victim, KILL_AFTER, killed))
            text, answer, decode = await asyncio.to_thread(_answer, router.url, prompt)
            killer.cancel()
            if killed:
                break
        assert killed and decode == victim.url, "no request was served by D2"
        colocated = complete(c.ref.url, prompt, MAX_TOKENS)
        assert text == colocated.choices[0].text
        assert colocated.usage is not None
        # The answer reads as vLLM's own non-streaming one: no field vLLM does not send,
        # the same object, finish_reason and kind of id.
        own = _post(c.ref.url, prompt).json()
        assert answer.keys() <= own.keys(), (answer.keys(), own.keys())
        assert answer["choices"][0].keys() <= own["choices"][0].keys()
        assert answer["object"] == own["object"] == "text_completion"
        assert answer["choices"][0]["finish_reason"] == own["choices"][0]["finish_reason"]
        assert answer["id"].startswith("cmpl-") and answer["model"] == own["model"]
        usage = answer["usage"]
        assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} \
            == {"prompt_tokens": colocated.usage.prompt_tokens,
                "completion_tokens": MAX_TOKENS,
                "total_tokens": colocated.usage.prompt_tokens + MAX_TOKENS}
        assert metric(router.url, "pdgate_migrations_total",
                      'mode="pull",result="kv"') == migrated0 + 1
        external1, local1 = kv_sources(c.d.url)
        print(f"\nMIGRATION vllm non-streaming: D2 killed after {killed[0]:.0f} tokens; D "
              f"external_kv_transfer +{external1 - external0}, local_compute "
              f"+{local1 - local0}, prompt {colocated.usage.prompt_tokens}")
        # D loaded the continued prefix (the prompt plus the tokens generated before the
        # kill) over NIXL and computed only the tail.
        assert external1 - external0 >= colocated.usage.prompt_tokens + KILL_AFTER - 1
        assert local1 - local0 <= BLOCK_SIZE
    finally:
        if victim is not d2:
            victim.stop()
