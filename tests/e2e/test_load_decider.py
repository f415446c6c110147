"""The measured-cost decider end to end: real shim engines, real router (`pdgate up`).

Once the prefill engine is congested (busy with requests sent to it directly, as another
router's would be: its /metrics shows them), long prompts run on the idle decode engine
alone, counted under `cost_direct`. Once the decode engine is busy decoding, they go through
P then D again: D alone would stall its streams (the guard). The answer equals the colocated
engine's either way. A non-streaming answer is no first token: only the stream's TTFT is
compared with its prediction (`pdgate_decider_prediction_ratio`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import (
    Cluster,
    complete,
    completion_text,
    metric,
    start_cluster,
    wait_pools_full,
)

pytestmark = pytest.mark.slow

LONG = "Paged attention stores keys and values in fixed size blocks of tokens. " * 10
CONFIG = """decider:
  type: measured-cost
  # probe_s 0: this test counts exact reasons (probes: tests/router/test_cost_model.py)
  params: {min_dwell_s: 0.0, margin: 0.2, itl_stall_s: 0.001, probe_s: 0}
engine_load_interval_s: 0.1
"""


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("decider")
    (tmp / "router.yaml").write_text(CONFIG)
    c = start_cluster(tmp, tiny_model_dir, extra=[f"--router-arg=--config={tmp}/router.yaml"])
    yield c
    c.stop()


def decisions(c: Cluster, reason: str) -> float:
    return metric(c.router, "pdgate_disagg_decisions_total", f'reason="{reason}"')


def through_router(c: Cluster, i: int) -> tuple[dict[str, Any], httpx.Headers]:
    body = {"model": "tiny", "prompt": f"{i} {LONG}", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    resp = httpx.post(c.router + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json(), resp.headers


def stream_through_router(c: Cluster, i: int) -> tuple[str, httpx.Headers]:
    body = {"model": "tiny", "prompt": f"{i} {LONG}", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": True}
    resp = httpx.post(c.router + "/v1/completions", json=body, timeout=120)
    return completion_text(resp, True), resp.headers


def ratios(c: Cluster, choice: str) -> float:
    """How many measured / predicted TTFTs the decider observed for `choice`."""
    return metric(c.router, "pdgate_decider_prediction_ratio_count", f'choice="{choice}"')


def keep_busy(url: str, stop: threading.Event) -> None:
    """Long generations sent to the engine itself, one after another, until `stop`."""
    body = {"model": "tiny", "prompt": "busy", "max_tokens": 400, "ignore_eos": True}
    while not stop.is_set():
        httpx.post(url + "/v1/completions", json=body, timeout=120)


def wait_metric(c: Cluster, role: str, ok: Callable[[float], bool]) -> None:
    deadline = time.monotonic() + 30
    while not ok(metric(c.router, "pdgate_engine_requests_running", f'role="{role}"')):
        assert time.monotonic() < deadline, f"the router never saw {role} as expected"
        time.sleep(0.05)


@contextlib.contextmanager
def busy(url: str, n: int) -> Iterator[None]:
    stop = threading.Event()
    threads = [threading.Thread(target=keep_busy, args=(url, stop)) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_long_prompts_go_where_the_first_token_comes_sooner(cluster: Cluster) -> None:
    p, d = cluster.prefill[0], cluster.decode[0]
    # The colocated answers first (the decode engine is idle again before the test runs).
    want = [complete(d, f"{i} {LONG}", max_tokens=12)["choices"][0]["text"] for i in range(7)]
    through_router(cluster, 99)  # the first P/D request sets up the KV link: not timed here
    wait_metric(cluster, "decode", lambda n: n == 0)

    with busy(p, 3):
        wait_metric(cluster, "prefill", lambda n: n >= 2)
        for i in range(3):
            got, headers = through_router(cluster, i)
            assert "x-pdgate-prefill-engine" not in headers, i  # D alone
            assert headers["x-pdgate-decode-engine"] == d
            assert got["choices"][0]["text"] == want[i]
        # Three whole answers, no first token among them: nothing to compare.
        assert ratios(cluster, "direct") == 0
        text, headers = stream_through_router(cluster, 6)
        assert "x-pdgate-prefill-engine" not in headers  # D alone, streamed
        assert text == want[6]
        assert ratios(cluster, "direct") == 1  # its first token, against its prediction
    assert decisions(cluster, "cost_direct") == 4

    wait_metric(cluster, "prefill", lambda n: n == 0)
    before = decisions(cluster, "decode_itl_guard") + decisions(cluster, "cost_disagg")
    with busy(d, 2):
        wait_metric(cluster, "decode", lambda n: n >= 2)
        for i in range(3, 6):
            got, headers = through_router(cluster, i)
            assert headers["x-pdgate-prefill-engine"] == p  # P then D
            assert got["choices"][0]["text"] == want[i]
    after = decisions(cluster, "decode_itl_guard") + decisions(cluster, "cost_disagg")
    assert after - before == 3
    assert decisions(cluster, "cost_direct") == 4
    # The router's dashboard shows the engines' own figures it decided on.
    engines = httpx.get(cluster.router + "/dashboard/state", timeout=10).json()["engines"]
    assert all(e["running"] is not None for e in engines)
    wait_pools_full(cluster)
