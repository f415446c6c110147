"""Habits of the tools people migrate from: vllm-router's policy names, `GET
/v1/models/{id}` (OpenAI's retrieve-model route) and `pdgate --version`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Awaitable, Callable

import pytest

from pdgate.router.config import ConfigError
from pdgate.router.policies import build_policy
from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]


@pytest.mark.parametrize(("alias", "policy_type"), [
    ("round_robin", "round-robin"),
    ("power_of_two", "power-of-two"),
    ("cache_aware", "prefix-text"),
    ("consistent_hash", "consistent-hash"),
])
def test_vllm_router_policy_names_build_the_same_policy(alias: str, policy_type: str) -> None:
    assert build_policy(alias).type == policy_type


def test_an_unknown_policy_name_lists_the_aliases_too() -> None:
    with pytest.raises(ConfigError, match="cache_aware"):
        build_policy("cache-awareness")


async def test_a_router_configured_with_vllm_router_names_serves(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p0, p1 = await make_engine(engine_id="P0"), await make_engine(engine_id="P1")
    d = await make_engine(engine_id="D0")
    router = await start_router([p0, p1], [d], prefill_policy="round_robin",
                                decode_policy="cache_aware")
    for _ in range(4):
        resp = await router.client.post("/v1/completions",
                                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200
    assert (len(p0.requests), len(p1.requests)) == (2, 2)  # taken in turn


async def test_retrieve_model(make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    router = await start_router([p], [d], served_model_name=[MODEL, "org/alias"])
    for name in (MODEL, "org/alias"):
        resp = await router.client.get(f"/v1/models/{name}")
        assert resp.status_code == 200
        assert resp.json()["id"] == name and resp.json()["object"] == "model"
    missing = await router.client.get("/v1/models/gpt-9")
    assert missing.status_code == 404
    err = missing.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("NotFoundError", "model_not_found",
                                                        "model")


def test_pdgate_version() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgate.cli", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("pdgate ") and out.split()[1][0].isdigit()
