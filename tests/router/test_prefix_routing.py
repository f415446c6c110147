"""Prefix hashing and indexes, vLLM KV-event decoding, the disaggregation decider, and two
router replicas that agree on placement through engines' KV events (real ZMQ)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from pdgate.engine_shim.kv_events import KVEventPublisher
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.prefix_cache import BlockStoredEvent
from pdgate.router.input.schema import ClientRequest, CompletionParams
from pdgate.router.policies.decider import PrefixDecider
from pdgate.router.policies.kv_events import AllCleared, KVEventIndex, Removed, Stored, decode_batch
from pdgate.router.policies.prefix_index import PrefixIndex, block_hashes
from tests.router.conftest import RunningRouter
from tests.router.fake_engine import FakeEngine

BS = 4


def test_block_hashes_chain_covers_the_whole_prefix() -> None:
    a = block_hashes(list(range(10)), BS)
    assert len(a) == 2  # the partial third block is not hashed
    assert block_hashes(list(range(8)) + [0, 0], BS) == a
    changed_first = block_hashes([99] + list(range(1, 10)), BS)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # chained


def test_index_stays_within_its_bound_under_unique_prompts() -> None:
    index = PrefixIndex(max_entries=500)
    for i in range(2000):
        prompt = [i] * (BS * 8)
        index.insert(f"e{i % 3}", block_hashes(prompt, BS))
        assert len(index) <= 500
    recent = block_hashes([1999] * (BS * 8), BS)
    assert index.match(recent, ["e0", "e1", "e2"])["e1"] == 8  # newest kept whole
    assert index.match(block_hashes([0] * (BS * 8), BS), ["e0"])["e0"] == 0  # oldest gone
    assert sum(index.blocks_of(e) for e in ("e0", "e1", "e2")) == len(index)


def test_index_eviction_keeps_the_roots_of_live_chains() -> None:
    index = PrefixIndex(max_entries=6)
    shared = block_hashes(list(range(4 * BS)), BS)
    index.insert("e", shared)
    index.insert("e", block_hashes([7] * (3 * BS), BS))  # pushes 1 entry out
    assert index.match(shared, ["e"])["e"] == 3  # the tail went, not the root


# ---- vLLM KV events ----

HASHES = [0xAAA, 0xBBB]
TOKENS = list(range(2 * BS))


def _legacy_array_batch() -> bytes:
    # vLLM <= 0.2x: batch and events are positional arrays, the event tag first.
    stored = ["BlockStored", HASHES, None, TOKENS, BS, None, "GPU"]
    removed = ["BlockRemoved", [HASHES[1]], "GPU"]
    return msgspec.msgpack.encode([time.time(), [stored, removed, ["AllBlocksCleared"]]])


def _map_batch() -> bytes:
    # newer vLLM: events are maps tagged by "type", with extra fields routers must ignore.
    stored = {"type": "BlockStored", "block_hashes": [b"\x01" * 32, b"\x02" * 32],
              "parent_block_hash": None, "token_ids": TOKENS, "block_size": BS,
              "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
              "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    removed = {"type": "BlockRemoved", "block_hashes": [b"\x02" * 32], "medium": "GPU"}
    return msgspec.msgpack.encode([time.time(), [stored, removed, {"type": "Future"}], 0])


@pytest.mark.parametrize("payload", [_legacy_array_batch(), _map_batch()], ids=["array", "map"])
def test_decode_batch_reads_both_vllm_encodings(payload: bytes) -> None:
    events = decode_batch(payload)
    stored, removed = events[0], events[1]
    assert isinstance(stored, Stored) and isinstance(removed, Removed)
    assert stored.token_ids == TOKENS and stored.block_size == BS and stored.parent is None
    assert removed.block_hashes == stored.block_hashes[1:]
    index = KVEventIndex(BS, 100)
    index.apply("e", events[:2])
    assert index.index.match(block_hashes(TOKENS, BS), ["e"]) == {"e": 1}


def test_event_index_chains_through_parents_and_larger_engine_blocks() -> None:
    index = KVEventIndex(BS, 100)
    tokens = list(range(6 * BS))
    index.apply("e", [Stored([1], None, tokens[: 2 * BS], 2 * BS),  # engine block = 2 of ours
                      Stored([2, 3], 1, tokens[2 * BS :], 2 * BS)])
    assert index.index.match(block_hashes(tokens, BS), ["e"]) == {"e": 6}
    index.apply("e", [Removed([3])])
    assert index.index.match(block_hashes(tokens, BS), ["e"]) == {"e": 4}
    index.apply("e", [Stored([9], 12345, tokens[: 2 * BS], 2 * BS),  # parent never seen
                      Stored([8], None, tokens[:3], 3)])  # not a multiple of ours
    assert index.ignored == {"unknown_parent": 1, "block_size_mismatch": 1}
    index.apply("e", [AllCleared()])
    assert len(index.index) == 0 and index.publishes("e")


# ---- decider ----


def _req(ids: list[int] | None, n: int = 1, batch: bool = False) -> ClientRequest:
    params = msgspec.convert({"prompt": "x", "n": n}, CompletionParams)
    req = ClientRequest("completion", "/v1/completions", {}, params, "r", {})
    req.prompt_token_ids, req.batch = ids, batch
    return req


DECIDER = [
    # (min_tokens, prefix_ratio, decode holds tokens, request, disagg, reason)
    (0, None, 0, _req(list(range(40))), True, "disagg"),
    (0, None, 0, _req(list(range(40)), n=2), False, "n_gt_1"),
    (0, None, 0, _req(None, batch=True), False, "batch_prompt"),
    (32, None, 0, _req(list(range(31))), False, "short_prompt"),
    (32, None, 0, _req(list(range(32))), True, "disagg"),
    (0, 0.75, 32, _req(list(range(40))), False, "decode_has_prefix"),
    (0, 0.9, 32, _req(list(range(40))), True, "disagg"),
    (0, None, 40, _req(list(range(40))), True, "disagg"),  # prefix rule off
    (64, 0.5, 40, _req(list(range(40)), n=3), False, "n_gt_1"),  # base rules first
]


@pytest.mark.parametrize(("min_tokens", "ratio", "held", "req", "disagg", "reason"), DECIDER)
def test_decider(min_tokens: int, ratio: float | None, held: int, req: ClientRequest,
                 disagg: bool, reason: str) -> None:
    decision = PrefixDecider(min_tokens, ratio, lambda ids: held).decide(req)
    assert (decision.disagg, decision.reason) == (disagg, reason)


async def test_short_prompts_skip_prefill_end_to_end(
    make_engine: Callable[..., Awaitable[FakeEngine]],
    start_router: Callable[..., Awaitable[RunningRouter]],
) -> None:
    p, d = await make_engine(engine_id="P"), await make_engine(engine_id="D")
    router = await start_router([p], [d], disagg_min_tokens=16)
    for prompt in (list(range(5, 10)), list(range(5, 40))):
        r = await router.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200
    assert len(p.prefills) == 1  # only the long prompt went through P
    labels = {"reason": "short_prompt"}
    assert router.metric("pdgate_disagg_decisions_total", labels) == 1
    assert router.metric("pdgate_disagg_decisions_total", {"reason": "disagg"}) == 1


# ---- two replicas, one view of the engines' caches ----


async def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def _batches(r: RunningRouter, engines: dict[str, KVEventPublisher]) -> float:
    return sum(r.metric("pdgate_kv_event_batches_total", {"engine": u}) for u in engines)


async def test_two_kv_events_replicas_route_a_prompt_to_the_same_engine(
    make_engine: Callable[..., Awaitable[FakeEngine]],
    start_router: Callable[..., Awaitable[RunningRouter]],
) -> None:
    prefills = [await make_engine(engine_id=f"P{i}") for i in range(3)]
    d = await make_engine(engine_id="D")
    pubs = {e.url: KVEventPublisher("tcp://127.0.0.1:*", BS, ShimMetrics.create())
            for e in prefills}
    for pub in pubs.values():
        pub.start()
    try:
        kw: dict[str, Any] = {
            "prefill_policy": "kv-events", "prefix_block_size": BS,
            "kv_events": [f"{url}={pub.endpoint}" for url, pub in pubs.items()],
        }
        a = await start_router(prefills, [d], **kw)
        b = await start_router(prefills, [d], **kw)
        await asyncio.sleep(0.3)  # PUB/SUB: subscriptions reach the publishers
        sent = 0
        for i in range(6):
            prompt = [1] + [(i * 37 + j) % 500 + 3 for j in range(8 * BS)]
            body = {"prompt": prompt, "max_tokens": 2}
            ra = await a.client.post("/v1/completions", json=body)
            engine = ra.headers["x-pdgate-prefill-engine"]
            # That engine now holds the prompt's blocks and says so, like vLLM would.
            full = len(prompt) // BS * BS
            pubs[engine].publish([BlockStoredEvent(tuple(range(i * 100, i * 100 + full // BS)),
                                                   None, tuple(prompt[:full]))])
            sent += 1
            for r in (a, b):
                await _wait_for(lambda r=r, n=sent: _batches(r, pubs) == n)  # type: ignore[misc]
            rb = await b.client.post("/v1/completions", json=body)
            assert rb.headers["x-pdgate-prefill-engine"] == engine, i
    finally:
        for pub in pubs.values():
            pub.close()
