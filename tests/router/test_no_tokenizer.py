"""A router whose configuration reads no prompt tokens starts without a tokenizer (`--model`
may be a served name with no local files and no model hub); one that needs a tokenizer and
cannot load it fails at startup, naming the flag and the feature."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdgate.router.config import RouterConfig
from pdgate.router.input.tokenizer_setup import token_readers
from pdgate.router.policies import POLICIES
from pdgate.router.policies.registry import build_policy
from tests.router.conftest import wait_until_ready
from tests.router.fake_engine import FakeEngine
from tests.router.test_config import free_port

MakeEngine = Callable[..., Awaitable[FakeEngine]]
ROOT = Path(__file__).parents[2]
NO_FILES = "some-org/no-such-model"  # neither a local directory nor reachable on a hub


def config(**kw: Any) -> RouterConfig:
    return RouterConfig(model=NO_FILES, prefill=["http://p:1"], decode=["http://d:1"], **kw)


@pytest.mark.parametrize("settings, reader", [
    ({}, None),
    ({"prefill_policy": "power-of-two", "decode_policy": "session"}, None),
    ({"disagg_prefix_ratio": 0.0}, None),
    ({"decode_policy": "prefix-aware"}, "prefix-aware policy (--decode-policy)"),
    ({"prefill_policy": "kv-events"}, "kv-events policy (--prefill-policy)"),
    ({"prefill_policy": "cache_aware"}, None),  # vllm-router's name for prefix-text
    ({"pd_mode": "notify"}, "--pd-mode notify"),
    ({"pd_mode": "push"}, "--pd-mode push"),
    ({"disagg_min_tokens": 64}, "--disagg-min-tokens"),
    ({"disagg_prefix_ratio": 0.5}, "--disagg-prefix-ratio"),
    ({"tokenize_prompts": "always"}, "--tokenize-prompts always"),
])
def test_token_readers_name_each_feature(settings: dict[str, Any], reader: str | None) -> None:
    readers = token_readers(config(**settings))
    assert readers == ([] if reader is None else [f"the {reader}" if "policy" in reader
                                                  else reader])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_token_readers_agree_with_the_policies_scorers(policy: str) -> None:
    needs = build_policy(policy).needs_tokens
    assert bool(token_readers(config(decode_policy=policy))) is needs


async def start_router(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgate.router", "--model", NO_FILES, *args,
        cwd=ROOT, stderr=asyncio.subprocess.PIPE,
        # Offline: a missing tokenizer fails at once instead of after the hub's retries.
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )


async def test_pull_round_robin_serves_without_a_tokenizer(make_engine: MakeEngine) -> None:
    p, d = await make_engine(), await make_engine()
    port = free_port()
    proc = await start_router("--prefill", p.url, "--decode", d.url, "--port", str(port),
                              "--prefill-policy", "round-robin", "--log-level", "info")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await wait_until_ready(client, proc)
            body = {"model": NO_FILES, "prompt": "x", "max_tokens": 4}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == "Hello world!"
            assert len(p.requests) == 1 and len(d.requests) == 1  # through P and D
    finally:
        proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0
    assert "prompts are not tokenized" in err.decode() and "prefix-aware" in err.decode()


async def test_a_needed_tokenizer_that_cannot_load_fails_at_startup() -> None:
    proc = await start_router("--prefill", "http://127.0.0.1:1", "--decode",
                              "http://127.0.0.1:2", "--decode-policy", "prefix-aware")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    message = err.decode()
    assert f"cannot load {NO_FILES!r}" in message
    assert "--tokenizer" in message and "prefix-aware policy (--decode-policy)" in message
