"""The shim's prefix cache: reuse across requests, eviction that never touches referenced
blocks, pools that still return to full, greedy output unchanged by reuse, and the KV
events it publishes in vLLM's format (decoded with the router's own decoder)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from pdgate.engine_shim.engine import Engine, EngineConfig
from pdgate.engine_shim.kv_cache import BlockPool, OutOfBlocks
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.prefix_cache import (
    BlockRemovedEvent,
    BlockStoredEvent,
    PrefixCache,
    block_hashes,
)
from pdgate.engine_shim.sampler import SamplingParams
from pdgate.engine_shim.sequence import GenerateRequest
from pdgate.router.policies.kv_events import KVEventIndex, Removed, Stored, decode_batch
from pdgate.router.policies.prefix_index import block_hashes as router_hashes

BS = 4


def cached_pool(n: int) -> BlockPool:
    return BlockPool(n, PrefixCache(BS))


def test_freed_prompt_blocks_stay_cached_and_count_as_free() -> None:
    pool = cached_pool(8)
    tokens = list(range(12))
    ids = pool.allocate(3)
    hashes = block_hashes(tokens, BS)
    pool.register(ids, hashes, tokens)
    assert (pool.num_cached, pool.num_free) == (3, 5)
    pool.free(ids)
    assert (pool.num_cached, pool.num_free) == (3, 8)  # evictable blocks are free
    again = pool.acquire_prefix(block_hashes(tokens[:8] + [99] * 4, BS))
    assert again == ids[:2] and pool.num_free == 6  # reused blocks are referenced again
    pool.free(again)
    assert pool.num_free == 8


def test_eviction_is_lru_and_never_takes_referenced_blocks() -> None:
    pool = cached_pool(4)
    a, b = [0, 1, 2, 3], [10, 11, 12, 13]
    ida, idb = pool.allocate(1), pool.allocate(1)
    pool.register(ida, block_hashes(a, BS), a)
    pool.register(idb, block_hashes(b, BS), b)
    pool.free(ida)  # a is evictable; b stays referenced (e.g. leased to a remote decode)
    taken = pool.allocate(3)  # 2 never used + the evictable one
    assert ida[0] in taken
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)  # b is referenced: never evicted
    assert pool.acquire_prefix(block_hashes(a, BS)) == []
    assert pool.acquire_prefix(block_hashes(b, BS)) == idb
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStoredEvent, BlockStoredEvent, BlockRemovedEvent]
    assert events[2].hashes == tuple(block_hashes(a, BS))


def test_double_free_of_a_shared_block_is_caught() -> None:
    pool = cached_pool(2)
    ids = pool.allocate(1)
    pool.register(ids, block_hashes([1, 2, 3, 4], BS), [1, 2, 3, 4])
    pool.share(ids)
    pool.free(ids)
    pool.free(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids)


# ---- engine level ----

SYSTEM = [1] + [(7 * i) % 500 + 3 for i in range(23)]  # 24 tokens: 6 full blocks
PROMPTS = [tuple(SYSTEM + tail) for tail in ([40, 41, 42], [50, 51], [60, 61, 62, 63, 64])]


async def _generate(engine: Engine, prompt: tuple[int, ...], rid: str) -> tuple[list[str], int]:
    req = GenerateRequest(request_id=rid, prompt_ids=prompt,
                          sampling=SamplingParams(temperature=0.0), max_tokens=10,
                          ignore_eos=True)
    parts, cached = [], 0
    async with await engine.open(req) as stream:
        async for out in stream:
            parts.append(out.text)
            cached = out.num_cached_tokens
    return parts, cached


def _engine(model_dir: Path, caching: bool, endpoint: str | None = None) -> Engine:
    return Engine.load(EngineConfig(model=str(model_dir), block_size=BS, num_blocks=40,
                                    prefix_caching=caching, kv_events_endpoint=endpoint),
                       ShimMetrics.create())


async def test_reuse_keeps_greedy_output_and_reports_cached_tokens(tiny_model_dir: Path) -> None:
    cold, warm = _engine(tiny_model_dir, False), _engine(tiny_model_dir, True)
    await cold.start()
    await warm.start()
    try:
        for i, prompt in enumerate(PROMPTS * 2):
            want, none = await _generate(cold, prompt, f"c{i}")
            got, cached = await _generate(warm, prompt, f"w{i}")
            assert got == want and none == 0
            # the first request computes everything; later ones reuse the system prompt's
            # 6 blocks, and a repeated prompt every full block but the one of its last token
            n = len(prompt)
            expected = 0 if i == 0 else (24 if i < 3 else (n - 1) // BS * BS)
            assert cached == expected, (i, cached)
        reg = warm.metrics.registry
        hits = reg.get_sample_value("pdgate_shim_prefix_cache_hits_total")
        queries = reg.get_sample_value("pdgate_shim_prefix_cache_queries_total")
        assert queries == sum(len(p) for p in PROMPTS) * 2 and hits and 0 < hits < queries
        assert warm.pool.num_free == warm.pool.num_total  # cached blocks count as free
        assert warm.pool.num_cached > 0
    finally:
        await cold.stop()
        await warm.stop()


async def test_pool_pressure_evicts_cache_and_pool_returns_to_full(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, True)
    await engine.start()
    try:
        # 12 distinct 24-token prompts x 6-7 blocks each >> 40 blocks: the cache must yield.
        for i in range(12):
            prompt = tuple([1] + [(i * 31 + j) % 500 + 3 for j in range(23)])
            await _generate(engine, prompt, f"p{i}")
        assert engine.pool.num_free == engine.pool.num_total
        assert 0 < engine.pool.num_cached <= engine.pool.num_total
    finally:
        await engine.stop()


async def test_published_events_follow_vllm_format_and_rebuild_the_cache_view(
    tiny_model_dir: Path,
) -> None:
    engine = _engine(tiny_model_dir, True, "tcp://127.0.0.1:*")
    await engine.start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        assert engine.kv_events is not None
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(engine.kv_events.endpoint)
        await asyncio.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
        await _generate(engine, PROMPTS[0], "e0")
        frames = await asyncio.wait_for(sub.recv_multipart(), 10)
        assert len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8
        events = decode_batch(frames[2])
        assert len(events) == 1 and isinstance(events[0], Stored)
        stored = events[0]
        assert stored.parent is None and stored.block_size == BS
        assert stored.token_ids == list(PROMPTS[0][: 6 * BS]) and len(stored.block_hashes) == 6
        # The router's index, fed these events, knows the engine holds the prompt's prefix.
        index = KVEventIndex(BS, 1000)
        index.apply("e", events)
        hashes = router_hashes(PROMPTS[1], BS)
        assert index.index.match(hashes, ["e"]) == {"e": 6}
        for i in range(30):  # pressure: evictions are published as BlockRemoved
            await _generate(engine, tuple([1] + [(i * 13 + j) % 500 + 3 for j in range(23)]),
                            f"x{i}")
        removed: list[Removed] = []
        while not removed:
            batch = decode_batch((await asyncio.wait_for(sub.recv_multipart(), 10))[2])
            index.apply("e", batch)
            removed += [e for e in batch if isinstance(e, Removed)]
        assert int.from_bytes(frames[1], "big") == 0
    finally:
        sub.close(linger=0)
        ctx.term()
        await engine.stop()
