"""`pdgate router --workers 2`, a real process: whichever worker answers a scrape, the
exposition has both workers' series (a `worker` label each), their request counts add up to
every request sent, and promtool finds the merged text clean."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.observability.promtool import check_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("workers") / "router.log"
    # No engine is up: every completion is a quick 503, counted like any request.
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdgate.cli", "router", "--model", str(tiny_model_dir),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "2", "--prefill", f"http://127.0.0.1:{_free_port()}",
         "--decode", f"http://127.0.0.1:{_free_port()}", "--prefill-policy", "round-robin"],
        cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        seen: set[str] = set()
        while len(seen) < 2:  # both workers serve (new connections spread over them)
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                seen.add(httpx.get(url + "/health", timeout=2).headers["x-pdgate-worker"])
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _requests_by_worker(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdgate_requests_total" and s.labels["route"] == "/v1/completions":
                found[s.labels["worker"]] = found.get(s.labels["worker"], 0) + s.value
    return found


def test_every_scrape_shows_the_whole_pod(router: str) -> None:
    def one(_: int) -> str:
        with httpx.Client() as client:  # a new connection each: both workers get some
            reply = client.post(router + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 2})
            assert reply.status_code == 503, reply.text
            return reply.headers["x-pdgate-worker"]

    # At once: each 503 waits out the router's wait for a ready engine.
    with ThreadPoolExecutor(REQUESTS) as pool:
        answered = set(pool.map(one, range(REQUESTS)))
    assert answered == {"0", "1"}
    time.sleep(2.5)  # each worker publishes its series every second
    scraped_by: set[str] = set()
    for _ in range(12):
        with httpx.Client() as client:
            reply = client.get(router + "/metrics", timeout=10)
        scraped_by.add(reply.headers["x-pdgate-worker"])
        by_worker = _requests_by_worker(reply.text)
        assert set(by_worker) == {"0", "1"}, by_worker
        assert sum(by_worker.values()) == REQUESTS, by_worker
        builds = [line for line in reply.text.splitlines()
                  if line.startswith("pdgate_build_info{")]
        assert len(builds) == 2 and all('worker="' in b for b in builds), builds
        assert 'process_resident_memory_bytes{worker="0"}' in reply.text
        assert 'process_resident_memory_bytes{worker="1"}' in reply.text
        assert check_metrics(reply.text) == ""
    assert scraped_by == {"0", "1"}  # whichever worker answered
