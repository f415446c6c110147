"""Data-parallel engines through a real router: fake vLLM engines serving N DP ranks behind
one URL (per-rank identities, the rank header honoured), in pull and push mode; one rank's
breaker; KV events steering prefix-aware routing to the rank that holds the blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
import zmq

from pdgate.router.dp_ranks import RANK_HEADER
from tests.router.conftest import MODEL, RunningRouter, until
from tests.router.fake_engine import FakeEngine, PushBoard, Recorded

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
BS = 4


def _rid(rec: Recorded) -> str:
    return str(rec.headers["X-Request-Id"])


def _prefills_by_rid(engines: list[FakeEngine]) -> dict[str, tuple[FakeEngine, Recorded]]:
    return {_rid(r): (e, r) for e in engines for r in e.prefills}


def _assert_pinned(engines: list[FakeEngine]) -> None:
    """Every leg carried the rank header, and the rank it names served it."""
    for e in engines:
        for rec in e.requests:
            assert rec.headers.get(RANK_HEADER) == str(rec.rank), (e.engine_id, rec.rank)


async def _post(router: RunningRouter, i: int, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": f"Hello number {i}", "max_tokens": 3, **extra}
    resp = await router.client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


async def test_pull_pins_each_leg_to_the_rank_chosen_for_it(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine(engine_id="P", dp_size=2)
    d = await make_engine(engine_id="D", dp_size=2, delay_s=0.2)
    router = await start_router([p], [d], prefill_dp_size=2, decode_dp_size=2)
    answers = await asyncio.gather(*(_post(router, i) for i in range(8)))
    assert {r.rank for r in p.prefills} == {0, 1}  # round-robin over P's two ranks
    assert {r.rank for r in d.decodes} == {0, 1}  # least-inflight over D's two ranks
    _assert_pinned([p, d])
    prefills = _prefills_by_rid([p])
    for dec in d.decodes:  # D reads from the rank that holds the prompt
        _, pre = prefills[_rid(dec)]
        assert dec.body["kv_transfer_params"]["remote_engine_id"] == f"P_dp{pre.rank}"
    for resp in answers:  # the response and access log name the rank
        rid = resp.headers["x-request-id"]
        _, pre = prefills[rid]
        assert resp.headers["x-pdgate-prefill-engine"] == f"{p.url}@{pre.rank}"
        assert resp.headers["x-pdgate-decode-engine"].startswith(f"{d.url}@")
    for rank in (0, 1):
        assert router.metric("pdgate_engine_in_flight",
                             {"engine": f"{p.url}@{rank}", "role": "prefill"}) == 0


def _check_push(ps: list[FakeEngine], ds: list[FakeEngine]) -> dict[str, list[Recorded]]:
    """Each request's last decode leg names the identity of the rank that ran its prefill
    (D registers with the rank that holds the prompt); returns decode legs by request."""
    prefills = _prefills_by_rid(ps)
    decodes: dict[str, list[Recorded]] = {}
    for d in ds:
        for rec in d.decodes:
            decodes.setdefault(_rid(rec), []).append(rec)
    assert set(decodes) == set(prefills)
    for rid, legs in decodes.items():
        p, pre = prefills[rid]
        named = legs[-1].body["kv_transfer_params"]
        assert named["remote_engine_id"] == p.rank_engine_id(pre.rank), rid
        assert named["remote_port"] == 5600 + (pre.rank or 0)
    return decodes


async def test_push_2p2d_with_dp2_engines_stays_concurrent_and_correct(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    board = PushBoard()
    ps = [await make_engine(engine_id=f"P{i}", dp_size=2, vllm_push=True, push_board=board,
                            kv_endpoints=False, delay_s=1.5) for i in range(2)]
    ds = [await make_engine(engine_id=f"D{i}", dp_size=2, kv_endpoints=False,
                            push_board=board) for i in range(2)]
    router = await start_router(ps, ds, pd_mode="push", prefill_dp_size=2,
                                decode_dp_size=2)
    for i in range(4):  # one per P rank (round-robin): each learns its rank's identity
        await _post(router, i)
    assert {(p.engine_id, r.rank) for p in ps for r in p.prefills} == {
        ("P0", 0), ("P0", 1), ("P1", 0), ("P1", 1)}
    warm = {_rid(r) for p in ps for r in p.prefills}
    await asyncio.gather(*(_post(router, i) for i in range(4, 20)))
    # Streams open with P's token (early first token): P first, then D, by design.
    streams = await asyncio.gather(*(_post(router, i, stream=True) for i in range(20, 28)))
    sequential = warm | {r.headers["x-request-id"] for r in streams}
    _assert_pinned([*ps, *ds])
    decodes = _check_push(ps, ds)
    prefills = _prefills_by_rid(ps)
    for rid, legs in decodes.items():
        assert len(legs) == 1, rid  # never re-driven
        if rid not in sequential:
            _, pre = prefills[rid]
            # Both legs at once: D's leg arrived while P was still on its prefill. A long
            # one (1.5 s): on a loaded machine the router's second leg once left 0.38 s
            # after its first.
            assert pre.delayed_until is not None and legs[0].at < pre.delayed_until, rid
    assert router.metric("pdgate_engine_answers_refused_total", {"reason": "dp_rank"}) == 0
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_kv_push"}) == 0


async def test_push_a_prefill_run_on_another_rank_is_counted_and_re_driven(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    """An engine that ignores the rank header runs a leg pinned to rank 0 on rank 1: D,
    told rank 0's identity, is sent again with rank 1's (the one P answered), never left
    waiting on a rank that does not hold the prompt."""
    board = PushBoard()
    p = await make_engine(engine_id="P", dp_size=2, vllm_push=True, kv_endpoints=False,
                          honour_rank_header=False, push_board=board, delay_s=0.2)
    d = await make_engine(engine_id="D", kv_endpoints=False, push_board=board)
    router = await start_router([p], [d], pd_mode="push", prefill_dp_size=2)
    for i in range(2):  # P's own turns match the router's: each rank learns its identity
        await _post(router, i)
    p._next_rank = 1  # from now on P runs each leg on the other rank
    for i in range(2, 6):
        await _post(router, i)
    decodes = _check_push([p], [d])
    assert router.metric("pdgate_engine_answers_refused_total", {"reason": "dp_rank"}) == 4
    assert sum(len(legs) == 2 for legs in decodes.values()) == 4  # re-driven, each once


async def test_one_ranks_breaker_opens_and_its_sibling_keeps_serving(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine(engine_id="P", dp_size=2, failing_ranks={1})
    d = await make_engine(engine_id="D")
    router = await start_router([p], [d], prefill_dp_size=2, eject_consecutive_errors=2,
                                breaker_open_s=60.0, admin_api_key="admin-secret-1")
    for i in range(8):
        await _post(router, i)
    assert router.metric("pdgate_breaker_opened_total", {"role": "prefill"}) == 1
    engines = (await router.client.get(
        "/admin/engines", headers={"Authorization": "Bearer admin-secret-1"})).json()
    state = {(e["url"], e["rank"]): e for e in engines["engines"] if e["role"] == "prefill"}
    assert state[(p.url, 1)]["breaker"] == "open"
    assert state[(p.url, 0)]["breaker"] == "closed"
    assert state[(p.url, 0)]["healthy"] and state[(p.url, 1)]["healthy"]  # one process
    assert [r.rank for r in p.prefills].count(1) == 2  # ejected after two failures
    assert all(r.rank == 0 for r in p.prefills[-4:])


def _stored_batch(tokens: list[int], rank: int) -> bytes:
    hashes = [hash((rank, tuple(tokens[: i + BS]))) for i in range(0, len(tokens), BS)]
    stored = ["BlockStored", hashes, None, tokens, BS, None, "GPU"]
    return msgspec.msgpack.encode([time.time(), [stored], rank])


def _pub_ranks(ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[list[zmq.Socket[bytes]], int]:
    """Two PUB sockets on consecutive ports, as vLLM binds ranks 0 and 1."""
    for _ in range(50):
        first = ctx.socket(zmq.PUB)
        base = first.bind_to_random_port("tcp://127.0.0.1")
        second = ctx.socket(zmq.PUB)
        try:
            second.bind(f"tcp://127.0.0.1:{base + 1}")
            return [first, second], base
        except zmq.ZMQError:
            first.close(linger=0)
            second.close(linger=0)
    raise AssertionError("no two consecutive free ports")


async def test_kv_events_of_rank_1_route_its_prefix_to_rank_1(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine(engine_id="P", dp_size=2)
    d = await make_engine(engine_id="D")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks, base = _pub_ranks(ctx)
    try:
        router = await start_router(
            [p], [d], prefill_dp_size=2, prefill_policy="kv-events", prefix_block_size=BS,
            kv_events=[f"{p.url}=tcp://127.0.0.1:{base}"])
        prompt = [1] + [(j * 7) % 500 + 3 for j in range(8 * BS - 1)]
        key = {"engine": f"{p.url}@1"}
        for seq in range(200):  # PUB/SUB: resend until the router's subscriber is in
            socks[1].send_multipart([b"", seq.to_bytes(8, "big"), _stored_batch(prompt, 1)])
            await asyncio.sleep(0.05)
            if router.metric("pdgate_kv_event_batches_total", key):
                break
        await until(lambda: router.metric("pdgate_kv_event_batches_total", key) > 0)
        for _ in range(4):
            resp = await router.client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert resp.status_code == 200
            assert resp.headers["x-pdgate-prefill-engine"] == f"{p.url}@1"
        assert [r.rank for r in p.prefills] == [1, 1, 1, 1]
        _assert_pinned([p])
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


async def test_dp_size_0_learns_the_ranks_from_the_engines_metrics(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine(engine_id="P", dp_size=2, serve_metrics=True)
    d = await make_engine(engine_id="D")  # no /metrics: stays one endpoint
    router = await start_router([p], [d], prefill_dp_size=0, decode_dp_size=0)
    answers = [await _post(router, i) for i in range(4)]
    assert [r.rank for r in p.prefills] == [0, 1, 0, 1]
    _assert_pinned([p])
    assert all(RANK_HEADER not in r.headers for r in d.requests)
    assert {a.headers["x-pdgate-prefill-engine"] for a in answers} == {
        f"{p.url}@0", f"{p.url}@1"}
    assert {a.headers["x-pdgate-decode-engine"] for a in answers} == {d.url}
