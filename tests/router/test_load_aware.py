"""Engine load signals and the `load-aware` policy: vLLM's /metrics gauges read per DP rank,
the scorer table-driven, and a real router polling fake engines over loopback sockets."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from pdgate.router.engine_load import EngineLoad, LoadPoller, load_interval_s, load_of_page
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import PickContext, PolicyEnv, build_policy, choose
from pdgate.router.pool import EndpointPool
from tests.router.conftest import MODEL, RunningRouter, until
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
CTX = PickContext("rid")
NOW = 100.0

PAGE = b"""# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="lora"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_running_total_x{engine="0"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 1.7
"""


def test_a_vllm_page_gives_each_dp_rank_its_load() -> None:
    got = load_of_page(PAGE, NOW)
    # Models summed per rank; a longer series name is not read; usage clamped to 1.
    assert got == {0: EngineLoad(3.0, 7.0, 0.5, NOW), 1: EngineLoad(2.0, 1.0, 1.0, NOW)}


def test_a_page_without_rank_labels_is_one_engine_and_garbage_is_skipped() -> None:
    page = (b"vllm:num_requests_waiting 4\nvllm:num_requests_running{x=\"1\"} nan-ish\n"
            b"vllm:num_requests_running 2\n# vllm:num_requests_running 9\n")
    assert load_of_page(page, NOW) == {None: EngineLoad(4.0, 2.0, None, NOW)}
    assert load_of_page(b"<html>not metrics</html>", NOW) == {}


@pytest.mark.parametrize(("configured", "needed", "expected"), [
    (None, True, 1.0), (None, False, 0.0), (0.0, True, 0.0), (0.25, False, 0.25),
])
def test_polling_interval(configured: float | None, needed: bool, expected: float) -> None:
    assert load_interval_s(configured, needed) == expected


# (in flight per engine, engine figures (waiting, running, kv usage, age s) or None, picks)
CASES = [
    # Nothing from the engines: the router's in-flight counts; ties rotate.
    ([0, 0, 0], [None, None, None], [0, 1, 2, 0]),
    ([3, 0, 1], [None, None, None], [1, 1]),
    # Engine 1 is idle for this router but its own queue is long (other routers' requests).
    ([0, 0, 0], [(0, 0, 0.0, 0), (6, 10, 0.0, 0), (0, 0, 0.0, 0)], [0, 2, 0, 2]),
    # Equal queues: the engine with more free KV wins.
    ([0, 0], [(0, 4, 0.9, 0), (0, 4, 0.2, 0)], [1, 1]),
    # A queued request weighs twice a running one.
    ([0, 0], [(3, 0, 0.0, 0), (0, 5, 0.0, 0)], [1, 1]),
    # The router's count wins when it is larger than what the engine said (a lagging page).
    ([8, 0], [(0, 1, 0.0, 0), (0, 4, 0.0, 0)], [1, 1]),
    # Figures older than stale_s are ignored: in-flight alone.
    ([1, 0], [(0, 0, 0.0, 0), (30, 30, 1.0, 10)], [1, 1]),
]


@pytest.mark.parametrize(("loads", "figures", "expected"), CASES)
async def test_load_aware_picks(
    loads: list[int], figures: list[tuple[float, float, float, float] | None],
    expected: list[int],
) -> None:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(len(loads))]
    pool = EndpointPool(urls, urls, RouterMetrics.create(CollectorRegistry()))
    for ep, load, fig in zip(pool.endpoints("decode"), loads, figures, strict=True):
        ep.in_flight = load
        if fig is not None:
            ep.load = EngineLoad(fig[0], fig[1], fig[2], NOW - fig[3])
    policy = build_policy("load-aware", PolicyEnv(clock=lambda: NOW))
    picks = [(await choose(pool, "decode", policy, CTX)).index for _ in expected]
    assert picks == expected


async def test_a_read_remembers_how_many_requests_were_this_routers() -> None:
    """The engine's figures include this router's requests in flight during the read; what
    is left over is other routers' work, and a request of ours that has ended since is not
    counted twice (the decider's guard read it as a busy decode engine)."""
    metrics = RouterMetrics.create(CollectorRegistry())
    pool = EndpointPool(["http://p"], ["http://d"], metrics)
    ep = pool.endpoints("decode")[0]
    page = b'vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_waiting 0.0\n'

    async def fetch(url: str) -> bytes | None:
        ep.in_flight -= 1  # one of ours ends while the page is read
        return page if url == "http://d" else None

    ep.in_flight = 2
    await LoadPoller(pool, fetch, metrics).round()
    assert ep.load is not None
    assert (ep.load.running, ep.load.mine, ep.load.others_running) == (3.0, 2, 1.0)
    assert pool.endpoints("prefill")[0].load is None  # unreadable: no figures


async def test_router_reads_the_engines_queues_and_routes_around_a_busy_one(
    make_engine: MakeEngine, start_router: StartRouter,
) -> None:
    p = await make_engine(engine_id="P")
    busy = await make_engine(engine_id="D0", serve_metrics=True, load={0: (12.0, 30.0, 0.8)})
    idle = await make_engine(engine_id="D1", serve_metrics=True, load={0: (0.0, 1.0, 0.1)})
    router = await start_router([p], [busy, idle], decode_policy="load-aware",
                                engine_load_interval_s=0.05)
    labels = {"engine": busy.url, "role": "decode"}
    await until(lambda: router.metric("pdgate_engine_requests_waiting", labels) == 12.0)
    assert router.metric("pdgate_engine_requests_running", labels) == 30.0
    assert router.metric("pdgate_engine_kv_usage", labels) == 0.8
    for i in range(4):
        resp = await router.client.post("/v1/completions", json={
            "model": MODEL, "prompt": f"hello {i}", "max_tokens": 2})
        assert resp.status_code == 200
        assert resp.headers["x-pdgate-decode-engine"] == idle.url
    assert busy.decodes == []
    # The busy engine drains: the next poll sees it and it gets requests again.
    busy.load = {0: (0.0, 0.0, 0.0)}
    idle.load = {0: (4.0, 8.0, 0.5)}
    await until(lambda: router.metric("pdgate_engine_requests_waiting", labels) == 0.0)
    await until(lambda: router.metric("pdgate_engine_requests_waiting",
                                      {"engine": idle.url, "role": "decode"}) == 4.0)
    resp = await router.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "after", "max_tokens": 2})
    assert resp.headers["x-pdgate-decode-engine"] == busy.url
    dash = (await router.client.get("/dashboard/state")).json()
    row = next(e for e in dash["engines"] if e["url"] == idle.url)
    assert (row["waiting"], row["running"], row["kv_usage"]) == (4.0, 8.0, 0.5)


async def test_no_polling_unless_something_reads_the_load(
    make_engine: MakeEngine, start_router: StartRouter,
) -> None:
    d = await make_engine(engine_id="D", serve_metrics=True, load={0: (5.0, 5.0, 0.5)})
    p = await make_engine(engine_id="P", serve_metrics=True)
    router = await start_router([p], [d])
    resp = await router.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200
    assert d.metrics_reads == p.metrics_reads == 0
    assert router.metric("pdgate_engine_requests_waiting",
                         {"engine": d.url, "role": "decode"}) == 0.0
