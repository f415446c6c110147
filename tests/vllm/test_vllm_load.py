"""Engine load signals and the measured-cost decider with real vLLM 0.32 engines (the
session's P, D and REF): a second router reads vLLM's own scheduler gauges from each
engine's /metrics (`vllm:num_requests_running`, `_waiting`, `vllm:kv_cache_usage_perc`),
and decides per request from what it measured; answers equal the colocated engine's."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdgate.router.engine_load import load_of_page
from tests.e2e.cluster import metric
from tests.vllm.conftest import VllmCluster
from tests.vllm.processes import ENGINE_KEY, SERVED_NAME
from tests.vllm.test_vllm_pd import IGNORE_EOS, client, complete

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = "The history of paged attention in serving systems begins with " * 6


@pytest.fixture(scope="module")
def router(vllm_cluster: VllmCluster) -> str:
    c = vllm_cluster
    proc = c.start_router("router-load", [c.p.url], [c.d.url], [
        "--decode-policy", "load-aware", "--decider", "measured-cost",
        "--engine-load-interval-s", "0.2"])
    return proc.url


def test_vllm_pages_parse_as_engine_load(vllm_cluster: VllmCluster) -> None:
    for proc in (vllm_cluster.p, vllm_cluster.d):
        page = httpx.get(proc.url + "/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {ENGINE_KEY}"}).content
        loads = load_of_page(page, 0.0)
        assert set(loads) == {0}, page[:2000]  # vLLM labels its one engine core engine="0"
        assert loads[0].kv_usage is not None


def test_router_sees_a_running_request_on_the_decode_engine(
    vllm_cluster: VllmCluster, router: str,
) -> None:
    d = vllm_cluster.d.url
    labels = f'engine="{d}"'
    seen: list[float] = []
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def stream() -> None:  # straight to D, as another router's request would be
        with httpx.stream("POST", d + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {ENGINE_KEY}"}) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass

    t = threading.Thread(target=stream)
    t.start()
    try:
        deadline = time.monotonic() + 120
        while t.is_alive() and time.monotonic() < deadline:
            running = metric(router, "pdgate_engine_requests_running", labels)
            usage = metric(router, "pdgate_engine_kv_usage", labels)
            seen.append(running)
            if running >= 1 and usage > 0:
                break
            time.sleep(0.1)
    finally:
        t.join()
    assert seen and max(seen) >= 1, seen
    deadline = time.monotonic() + 30
    while metric(router, "pdgate_engine_requests_running", labels) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def streamed(url: str, prompt: str, max_tokens: int) -> str:
    """The text of a greedy streamed completion of exactly `max_tokens` tokens."""
    chunks = client(url).completions.create(model=SERVED_NAME, prompt=prompt,
                                            max_tokens=max_tokens, temperature=0,
                                            extra_body=IGNORE_EOS, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_measured_cost_decisions_answer_as_colocated(
    vllm_cluster: VllmCluster, router: str,
) -> None:
    ref = vllm_cluster.ref.url
    for i in range(4):
        prompt = f"{i} {PROMPT}"
        got = streamed(router, prompt, 8)
        assert got == complete(ref, prompt, 8).choices[0].text
    # A non-streaming answer is decided too, but shows no first token to compare.
    got_whole = complete(router, f"4 {PROMPT}", 8)
    assert got_whole.choices[0].text == complete(ref, f"4 {PROMPT}", 8).choices[0].text
    decided = sum(metric(router, "pdgate_disagg_decisions_total", f'reason="{r}"')
                  for r in ("cost_disagg", "cost_direct", "decode_itl_guard",
                            "decode_stall_cost", "probe"))
    assert decided == 5
    assert metric(router, "pdgate_decider_prediction_ratio_count") == 4
