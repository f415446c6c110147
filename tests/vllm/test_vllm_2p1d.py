"""Two real vLLM prefill engines (P and REF) and one decode engine behind pdgate's router:
round-robin, prefix-aware, and the kv-events policy fed by vLLM's own KV cache events."""

from __future__ import annotations

import time

import pytest

from tests.e2e.cluster import metric
from tests.vllm.conftest import VllmCluster
from tests.vllm.processes import SERVED_NAME, Proc
from tests.vllm.test_vllm_pd import IGNORE_EOS, client, complete, kv_sources, unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def routed(router: str, prompt: str, max_tokens: int = 6) -> tuple[str, str, int]:
    """(prefill engine URL, text, prompt tokens) of one greedy request through `router`."""
    raw = client(router).completions.with_raw_response.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body=IGNORE_EOS)
    done = raw.parse()
    assert done.usage is not None and done.usage.completion_tokens == max_tokens
    return raw.headers["x-pdgate-prefill-engine"], done.choices[0].text, done.usage.prompt_tokens


def test_round_robin_over_two_prefill_engines(vllm_cluster: VllmCluster) -> None:
    c = vllm_cluster
    router = c.start_router("router-2p1d-rr", [c.p.url, c.ref.url], [c.d.url],
                            ["--prefill-policy", "round-robin"])
    external0, local0 = kv_sources(c.d.url)
    results = [routed(router.url, unique_prompt(30)) for _ in range(4)]
    external1, local1 = kv_sources(c.d.url)
    assert [r[0] for r in results] == [c.p.url, c.ref.url, c.p.url, c.ref.url]
    # D pulled every prompt from whichever engine prefilled it, and computed none itself.
    assert external1 - external0 == sum(r[2] for r in results)
    assert local1 == local0


def test_prefix_aware_keeps_a_prefix_on_one_prefill_engine(vllm_cluster: VllmCluster) -> None:
    c = vllm_cluster
    router = c.start_router("router-2p1d-prefix", [c.p.url, c.ref.url], [c.d.url],
                            ["--prefill-policy", "prefix-aware"])
    shared = unique_prompt(120)
    first, _, _ = routed(router.url, shared)
    again = [routed(router.url, shared + f" Question {i}?")[0] for i in range(3)]
    assert again == [first] * 3
    other, _, _ = routed(router.url, unique_prompt(120))
    assert other != first  # a new prefix goes to the engine holding fewer blocks


def _batches(router: str, engine: Proc) -> float:
    return metric(router, "pdgate_kv_event_batches_total", f'engine="{engine.url}"')


def _await_batch(router: str, engine: Proc, before: float, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _batches(router, engine) > before:
            return True
        time.sleep(0.1)
    return False


def _ensure_subscribed(router: str, engine: Proc) -> None:
    """Make `engine` store fresh blocks until the router has received one KV-event batch
    from it: a ZMQ subscriber misses whatever was published before it joined."""
    for _ in range(5):
        before = _batches(router, engine)
        complete(engine.url, unique_prompt(40), 1)
        if _await_batch(router, engine, before):
            return
    raise AssertionError(f"router received no KV events from {engine.name}")


def test_kv_events_policy_tracks_real_vllm_blocks(vllm_cluster: VllmCluster) -> None:
    """A prompt whose prefix one engine holds (it computed it for a direct, colocated
    request, so the router never routed it) goes to that engine: the router knows only
    from the engine's published BlockStored events."""
    c = vllm_cluster
    router = c.start_router(
        "router-2p1d-kv", [c.p.url, c.ref.url], [c.d.url],
        ["--prefill-policy", "kv-events", "--kv-events", c.kv_events(c.p),
         "--kv-events", c.kv_events(c.ref)])
    for engine in (c.ref, c.p, c.ref, c.p):
        _ensure_subscribed(router.url, engine)
        prefix = unique_prompt(120)
        before = _batches(router.url, engine)
        complete(engine.url, prefix, 1)  # colocated: the engine caches the prefix blocks
        assert _await_batch(router.url, engine, before)
        served, text, _ = routed(router.url, prefix + " And then?")
        assert served == engine.url, engine.name
        assert text == complete(c.ref.url, prefix + " And then?", 6).choices[0].text
