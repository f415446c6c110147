"""Data-parallel ranks as endpoints (router/dp_ranks.py): the pool's rank endpoints, their
breakers and per-URL health, KV events keyed per rank (real ZMQ), and the push flow's
identity cache per rank. Flows through a router: tests/router/test_dp_flows.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from pdgate.router.cli import config_from_args
from pdgate.router.config import ConfigError, RouterConfig
from pdgate.router.config_checks import validate_config
from pdgate.router.discovery import DP_SIZE_LABEL, ApiServer, PodWatcher, WatchSpec
from pdgate.router.dp_ranks import (
    RANK_HEADER,
    dp_size_of_metrics,
    endpoint_key,
    rank_endpoint,
    split_key,
)
from pdgate.router.engines.client import EngineClient
from pdgate.router.flows.common import KVInfoCache
from pdgate.router.flows.push_identity import Learned, PushPeers, VllmIdentity
from pdgate.router.health import BreakerState, HealthSettings
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies.base import PickContext, PolicyEnv
from pdgate.router.policies.kv_events import (
    KVEventIndex,
    decode_batch_ranked,
    running_subscribers,
)
from pdgate.router.policies.prefix_index import PrefixIndex
from pdgate.router.policies.scorers import PrefixScorer
from pdgate.router.pool import Endpoint, EndpointPool
from tests.router.test_discovery import NS, PREFILL, FakeApiServer, make_pod

P_URL, D_URL = "http://p:8100", "http://d:8200"
BS = 4


REGISTRIES: dict[int, CollectorRegistry] = {}


def _pool(p_dp: int = 2, d_dp: int = 1, **kw: Any) -> tuple[EndpointPool, RouterMetrics]:
    registry = RouterMetrics.registry()
    metrics = RouterMetrics.create(registry)
    REGISTRIES[id(metrics)] = registry
    pool = EndpointPool([P_URL + "/"], [D_URL], metrics,
                        dp_size={"prefill": p_dp, "decode": d_dp}, **kw)
    return pool, metrics


def _sample(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return REGISTRIES[id(metrics)].get_sample_value(name, labels)


def test_names_of_ranks() -> None:
    assert endpoint_key(P_URL, None) == P_URL and endpoint_key(P_URL, 3) == f"{P_URL}@3"
    assert split_key(f"{P_URL}@3") == (P_URL, 3) and split_key(P_URL) == (P_URL, None)
    assert split_key("http://user@host:1") == ("http://user@host:1", None)
    assert rank_endpoint("tcp://h:5557", 0) == "tcp://h:5557"
    assert rank_endpoint("tcp://h:5557", 2) == "tcp://h:5559"
    with pytest.raises(ValueError):
        rank_endpoint("inproc://x", 1)


def test_vllm_metrics_say_how_many_ranks() -> None:
    page = (b'# HELP vllm:num_requests_running x\n'
            b'vllm:num_requests_running{model_name="m",engine="0"} 0.0\n'
            b'vllm:num_requests_running{model_name="m",engine="1"} 2.0\n'
            b'vllm:num_requests_waiting{model_name="m",engine="7"} 0.0\n')
    assert dp_size_of_metrics(page) == 2
    assert dp_size_of_metrics(b"pdgate_requests_total 1\n") is None


def test_a_dp_url_is_one_endpoint_per_rank_and_legs_are_pinned() -> None:
    pool, metrics = _pool(p_dp=2, d_dp=1)
    p0, p1 = pool.endpoints("prefill")
    [d] = pool.endpoints("decode")
    assert (p0.key, p1.key, d.key) == (f"{P_URL}@0", f"{P_URL}@1", D_URL)
    assert (p0.url, p1.url) == (P_URL, P_URL) and d.rank is None
    base = {"X-Request-Id": "r1"}
    assert p1.pin(base) == {"X-Request-Id": "r1", RANK_HEADER: "1"}
    assert d.pin(base) is base  # not data-parallel: no header, no copy
    assert pool.dp_size(P_URL) == 2 and pool.dp_size(D_URL) == 1
    with pool.track(p1):
        assert (p0.in_flight, p1.in_flight) == (0, 1)
        assert _sample(metrics, "pdgate_engine_in_flight", engine=f"{P_URL}@1",
                       role="prefill") == 1


def test_one_ranks_breaker_opens_without_ejecting_its_siblings() -> None:
    pool, metrics = _pool(health=HealthSettings(eject_after=2))
    p0, p1 = pool.endpoints("prefill")
    p1.health.record_failure()
    p1.health.record_failure()
    assert p1.health.state is BreakerState.OPEN
    assert pool.healthy("prefill") == [p0]
    assert p0.health.state is BreakerState.CLOSED and pool.ready()


async def test_health_is_probed_once_per_url_and_shared_by_its_ranks() -> None:
    pool, _ = _pool(p_dp=3, d_dp=2, health=HealthSettings(failure_threshold=1))
    probed: list[str] = []

    async def probe(ep: Endpoint) -> bool:
        probed.append(ep.url)
        return ep.url == D_URL

    await pool.check_all(probe)
    assert sorted(probed) == [D_URL, P_URL]
    assert [ep.healthy for ep in pool.endpoints("prefill")] == [False] * 3
    assert [ep.healthy for ep in pool.endpoints("decode")] == [True] * 2


def test_ranks_are_added_resized_drained_and_removed_together() -> None:
    pool, _ = _pool(p_dp=1, d_dp=1)
    first = pool.add("http://q:1", "prefill", dp_size=2)
    assert first.key == "http://q:1@0"
    assert pool.add("http://q:1", "prefill") is first  # idempotent
    assert [ep.key for ep in pool.endpoints("prefill")] == [P_URL, "http://q:1@0",
                                                            "http://q:1@1"]
    assert pool.resize(P_URL, "prefill", 2)
    assert [ep.key for ep in pool.endpoints("prefill")][:2] == [f"{P_URL}@0", f"{P_URL}@1"]
    assert not pool.resize(P_URL, "prefill", 2)
    busy = pool.endpoints("prefill")[3]
    with pool.track(busy):
        assert pool.drain("http://q:1")
        assert [ep.key for ep in pool.endpoints("prefill")] == [f"{P_URL}@0", f"{P_URL}@1",
                                                                "http://q:1@1"]
    assert [ep.key for ep in pool.endpoints("prefill")] == [f"{P_URL}@0", f"{P_URL}@1"]
    assert pool.remove(P_URL) and pool.endpoints("prefill") == []


# ---- KV events per rank ----


def _batch(tokens: list[int], rank: int | None, *, as_map: bool = False) -> bytes:
    stored = ["BlockStored", [hash(tuple(tokens))], None, tokens, len(tokens), None, "GPU"]
    if as_map:
        return msgspec.msgpack.encode({"ts": time.time(), "events": [stored],
                                       "data_parallel_rank": rank})
    return msgspec.msgpack.encode([time.time(), [stored], rank])


def test_batches_carry_their_rank() -> None:
    tokens = list(range(BS))
    assert decode_batch_ranked(_batch(tokens, 1))[1] == 1
    assert decode_batch_ranked(_batch(tokens, 1, as_map=True))[1] == 1
    assert decode_batch_ranked(_batch(tokens, None))[1] is None
    legacy = msgspec.msgpack.encode([time.time(), []])
    assert decode_batch_ranked(legacy) == ([], None)


def _bind_consecutive(ctx: zmq.Context[zmq.Socket[bytes]], n: int
                      ) -> tuple[list[zmq.Socket[bytes]], int]:
    """PUB sockets on n consecutive free ports (vLLM's rank r: port + r)."""
    for _ in range(50):
        socks = [ctx.socket(zmq.PUB)]
        base = socks[0].bind_to_random_port("tcp://127.0.0.1")
        try:
            for r in range(1, n):
                s = ctx.socket(zmq.PUB)
                socks.append(s)
                s.bind(f"tcp://127.0.0.1:{base + r}")
            return socks, base
        except zmq.ZMQError:
            for s in socks:
                s.close(linger=0)
    raise AssertionError("no consecutive free ports")


async def _until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("batch_rank", [True, False], ids=["batch-rank", "socket-rank"])
async def test_a_prefix_held_by_rank_1_scores_rank_1(batch_rank: bool) -> None:
    """Two publishers, like vLLM's two ranks (port, port + 1); only rank 1 stores the
    prompt's blocks. The index holds them under `url@1`, and the prefix scorer prefers
    rank 1 over rank 0 of the same URL. Without a batch rank the socket's rank is used."""
    pool, _ = _pool(p_dp=2)
    index = KVEventIndex(BS, 1000)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks, base = _bind_consecutive(ctx, 2)
    seen: list[str] = []
    tokens = list(range(100, 100 + 4 * BS))
    try:
        async with running_subscribers({P_URL: f"tcp://127.0.0.1:{base}"}, index,
                                       lambda key, n, gap: seen.append(key), pool.dp_size):
            payload = _batch(tokens, 1 if batch_rank else None)
            for i in range(100):  # PUB/SUB: resend until the subscriber has joined
                socks[1].send_multipart([b"", i.to_bytes(8, "big"), payload])
                await asyncio.sleep(0.05)
                if seen:
                    break
            await _until(lambda: bool(seen))
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    assert set(seen) == {f"{P_URL}@1"}
    env = PolicyEnv(BS, PrefixIndex(1000), index)
    ctx_req = PickContext("r", tokens)
    p0, p1 = pool.endpoints("prefill")
    assert PrefixScorer(env, use_events=True).score([p0, p1], ctx_req) == [0.0, 1.0]


async def test_a_url_held_as_one_endpoint_ignores_the_batch_rank() -> None:
    """External load balancing: one URL per rank (`--data-parallel-rank 1`): its batches
    say rank 1, but the URL is the endpoint."""
    index = KVEventIndex(BS, 1000)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    seen: list[str] = []
    try:
        async with running_subscribers({D_URL: f"tcp://127.0.0.1:{port}"}, index,
                                       lambda key, n, gap: seen.append(key), lambda u: 1):
            for i in range(100):
                sock.send_multipart([b"", i.to_bytes(8, "big"), _batch(list(range(BS)), 1)])
                await asyncio.sleep(0.05)
                if seen:
                    break
    finally:
        sock.close(linger=0)
        ctx.term()
    assert seen and set(seen) == {D_URL} and index.publishes(D_URL)


# ---- push identities per rank ----


def _answer(engine_id: str, port: int) -> dict[str, Any]:
    return {"transfer_mode": "push", "remote_engine_id": engine_id, "remote_host": "h",
            "remote_port": port, "tp_size": 1, "pp_size": 1, "remote_request_id": "x"}


async def test_push_identities_are_cached_per_rank_and_a_sibling_answer_is_counted(
) -> None:
    pool, metrics = _pool(p_dp=2)
    p0, p1 = pool.endpoints("prefill")
    engines = EngineClient.create(RouterConfig(model="m"))
    try:
        peers = PushPeers(KVInfoCache(engines), metrics)
        _learn_per_rank(peers, p0, p1, metrics)
    finally:
        await engines.close()


def _learn_per_rank(peers: PushPeers, p0: Endpoint, p1: Endpoint,
                    metrics: RouterMetrics) -> None:
    assert peers.learn(p0, _answer("P_dp0", 5600), None) is Learned.CHANGED
    assert peers.learn(p1, _answer("P_dp1", 5601), None) is Learned.CHANGED
    id0, id1 = peers.identity(p0), peers.identity(p1)
    assert id0 == VllmIdentity("P_dp0", "h", 5600) and id1 == VllmIdentity("P_dp1", "h", 5601)
    assert peers.learn(p1, _answer("P_dp1", 5601), id1) is Learned.SAME
    # The engine ran rank 1's leg on rank 0: D must be told rank 0 (re-driven), counted,
    # and rank 1 keeps its own identity.
    assert peers.learn(p1, _answer("P_dp0", 5600), id1) is Learned.CHANGED
    assert peers.identity(p1) == id1 and peers.rank_mismatches == 1
    assert _sample(metrics, "pdgate_engine_answers_refused_total", reason="dp_rank") == 1
    # Not learnt yet, but vLLM's engine id names its rank (`_dp0`): still a mismatch.
    peers.forget(p1)
    assert peers.learn(p1, _answer("P_dp0", 5600), None) is Learned.CHANGED
    assert peers.identity(p1) is None and peers.rank_mismatches == 2
    # A restart under a new id on the rank asked is learnt, not a mismatch.
    assert peers.learn(p1, _answer("Pnew_dp1", 5601), id1) is Learned.CHANGED
    assert peers.identity(p1) == VllmIdentity("Pnew_dp1", "h", 5601)
    assert peers.rank_mismatches == 2


# ---- discovery: the DP size of a pod's engine from its label ----


async def test_a_pods_dp_size_label_makes_its_ranks_endpoints() -> None:
    pool, _ = _pool(p_dp=1)
    pool.remove(P_URL)
    server = FakeApiServer()
    await server.start()
    labelled = make_pod("p0", "prefill", "10.0.0.1")
    labelled["metadata"]["labels"][DP_SIZE_LABEL] = "2"
    await server.put(labelled)
    await server.put(make_pod("p1", "prefill", "10.0.0.2"))  # no label: the role's size
    try:
        async with httpx.AsyncClient() as session:
            w = PodWatcher(session, ApiServer(server.url, NS),
                           WatchSpec("prefill", PREFILL, 8100), pool)
            task = asyncio.create_task(w.run())
            try:
                await asyncio.wait_for(w.synced.wait(), 10)
                late = make_pod("p2", "prefill", "10.0.0.3")  # arrives through the watch
                late["metadata"]["labels"][DP_SIZE_LABEL] = "3"
                await server.put(late)
                await _until(lambda: len(pool.endpoints("prefill")) == 6)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    finally:
        await server.stop()
    assert [ep.key for ep in pool.endpoints("prefill")] == [
        "http://10.0.0.1:8100@0", "http://10.0.0.1:8100@1", "http://10.0.0.2:8100",
        "http://10.0.0.3:8100@0", "http://10.0.0.3:8100@1", "http://10.0.0.3:8100@2"]


def test_dp_size_flags_and_vllm_routers_spelling() -> None:
    base = ["--model", "m", "--prefill", "http://p:1", "--decode", "http://d:2"]
    config = config_from_args([*base, "--prefill-dp-size", "4", "--decode-dp-size", "0"])
    assert (config.prefill_dp_size, config.decode_dp_size) == (4, 0)
    config = config_from_args([*base, "--intra-node-data-parallel-size", "2"])
    assert (config.prefill_dp_size, config.decode_dp_size) == (2, 2)
    with pytest.raises(ConfigError, match="prefill_dp_size"):
        validate_config(RouterConfig(model="m", prefill=["http://p:1"], decode=["http://d:2"],
                                     prefill_dp_size=-1), frozenset({"round-robin"}))


async def test_a_dp_engine_held_as_one_endpoint_gets_one_hint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool, metrics = _pool(p_dp=1)
    [p] = pool.endpoints("prefill")
    engines = EngineClient.create(RouterConfig(model="m"))
    try:
        peers = PushPeers(KVInfoCache(engines), metrics)
        for rank in (0, 1, 0):
            peers.learn(p, _answer(f"P_dp{rank}", 5600 + rank), peers.identity(p))
    finally:
        await engines.close()
    hints = [r for r in caplog.records if "--prefill-dp-size" in r.getMessage()]
    assert len(hints) == 1 and peers.rank_mismatches == 0
