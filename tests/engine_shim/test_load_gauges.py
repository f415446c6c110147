"""The shim publishes vLLM's scheduler gauges under vLLM's names, so the router reads a
shim's load exactly as it reads vLLM's (router/engine_load.py parses the real page here)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdgate.router.engine_load import load_of_page
from tests.engine_shim.live import MODEL, Shim, start_shim, stop_shim


@pytest.fixture(scope="module")
def shim(tiny_model_dir: Path) -> Iterator[Shim]:
    s = start_shim(tiny_model_dir)
    yield s
    stop_shim(s)


def _load(shim: Shim) -> tuple[float, float, float | None]:
    page = httpx.get(shim.url + "/metrics", timeout=10).content
    got = load_of_page(page, 0.0)
    assert set(got) == {0}  # one engine core: rank 0, as vLLM labels it
    return got[0].waiting, got[0].running, got[0].kv_usage


def test_running_requests_and_kv_usage_show_while_a_stream_runs(shim: Shim) -> None:
    assert _load(shim) == (0.0, 0.0, 0.0)
    body = {"model": MODEL, "prompt": "Hello " * 20, "max_tokens": 150, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", shim.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it is running now
        waiting, running, usage = _load(shim)
        assert (waiting, running) == (0.0, 1.0)
        assert usage is not None and 0.0 < usage < 1.0
        for _ in lines:
            pass
    deadline = time.monotonic() + 5
    while _load(shim) != (0.0, 0.0, 0.0):
        assert time.monotonic() < deadline, _load(shim)
        time.sleep(0.02)
