"""Priority and per-key token quotas through a real `pdgate up` cluster (shim engines, the
router as its own process, loopback sockets): client keys from the router's config, the
priority forwarded to both engines (the shim accepts it), and a key's quota counted from
the usage the engines reported, streams whose client asked for no usage included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, completion_text, start_cluster

pytestmark = pytest.mark.slow

PROMPT_IDS = list(range(20, 30))  # 10 prompt tokens, whatever the tokenizer
MAX_TOKENS = 6
COST = len(PROMPT_IDS) + MAX_TOKENS  # ignore_eos: every request costs exactly this
TEAM = "sk-e2e-team-key-1"
GOLD = "sk-e2e-gold-key-2"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    keys = json.dumps([
        {"key": TEAM, "name": "team", "priority": 2, "tokens_per_minute": 2 * COST},
        {"key": GOLD, "name": "gold", "priority": -1}])
    c = start_cluster(tmp_path_factory.mktemp("prio"), tiny_model_dir,
                      extra=[f"--router-arg=--client-keys={keys}",
                             "--router-arg=--forward-priority"])
    yield c
    c.stop()


def _post(c: Cluster, key: str, stream: bool, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    return httpx.post(c.router + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def test_priorities_reach_the_shims_and_answers_equal_colocated(cluster: Cluster) -> None:
    alone = httpx.post(cluster.decode[0] + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})  # the decode engine alone: the colocated answer
    expected = completion_text(alone, False)
    for stream in (False, True):
        for extra in ({}, {"priority": -7}, {"priority": 9}):
            assert completion_text(_post(cluster, GOLD, stream, **extra), stream) == expected
    resp = _post(cluster, GOLD, False, priority="soon")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
    resp = httpx.post(cluster.router + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "x"}, headers={"Authorization": "Bearer sk-unknown-key"})
    assert resp.status_code == 401


def test_a_key_quota_counts_the_engines_usage_and_says_when_to_retry(
        cluster: Cluster) -> None:
    first = _post(cluster, TEAM, False)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["total_tokens"] == COST
    # A stream whose client asked for no usage chunk: the router still counts it.
    second = _post(cluster, TEAM, True)
    assert second.status_code == 200
    assert not any(json.loads(line[6:]).get("usage") for line in second.text.splitlines()
                   if line.startswith("data: {"))
    # 2 x COST used: the quota (2 x COST per minute) is spent.
    third = _post(cluster, TEAM, False)
    assert third.status_code == 429, third.text
    err = third.json()["error"]
    assert (err["type"], err["code"]) == ("RateLimitError", "rate_limit_exceeded")
    assert 50 <= int(third.headers["Retry-After"]) <= 60
    assert TEAM not in third.text
    # The other key has no quota and is served.
    assert _post(cluster, GOLD, False).status_code == 200
