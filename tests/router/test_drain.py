"""The drain on SIGTERM (router/http/drain.py), on a real `python -m pdgate.router` process
in front of fake engines on loopback: `/ready` fails first, requests are still served for
`--drain-delay-s`, then the graceful shutdown lets streams finish and the process exits 0.
(`--workers`: tests/router/test_workers.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import sse_events, wait_until_ready
from tests.router.fake_engine import FakeEngine
from tests.router.test_config import free_port

ROOT = Path(__file__).resolve().parents[2]
DRAIN_S = 6.0  # long enough for the checks inside it on a loaded 2-core machine
BODY = {"model": "tiny", "prompt": "x", "max_tokens": 3}


async def _router(tiny: Path, p: FakeEngine, d: FakeEngine,
                  *extra: str) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgate.router", "--model", str(tiny), "--prefill", p.url,
        "--decode", d.url, "--port", str(port), "--served-model-name", "tiny",
        "--log-level", "warning", "--shutdown-timeout-s", "20", *extra, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
async def router_procs() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    procs: list[asyncio.subprocess.Process] = []
    yield procs
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _ready_on_new_connection(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5.0) as fresh:
        return await fresh.get(url + "/ready")


async def _until_draining(url: str, within_s: float) -> httpx.Response:
    deadline = time.monotonic() + within_s
    while True:
        resp = await _ready_on_new_connection(url)
        if resp.status_code == 503 or time.monotonic() > deadline:
            return resp
        await asyncio.sleep(0.02)


async def test_sigterm_fails_ready_first_serves_through_the_delay_then_exits_0(
    tiny_model_dir: Path, make_engine: Callable[..., Awaitable[FakeEngine]],
    router_procs: list[asyncio.subprocess.Process],
) -> None:
    # D streams a token every 4 s: a stream started before SIGTERM outlives the drain, so
    # the graceful shutdown after it lets the stream finish.
    p, d = await make_engine(), await make_engine(token_delay_s=4.0)
    proc, url = await _router(tiny_model_dir, p, d, "--drain-delay-s", str(DRAIN_S))
    router_procs.append(proc)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await wait_until_ready(client, proc)
        first_chunk = asyncio.Event()

        async def stream() -> str:
            async with client.stream("POST", "/v1/completions",
                                     json={**BODY, "stream": True}) as resp:
                assert resp.status_code == 200
                text = ""
                async for chunk in resp.aiter_text():
                    text += chunk
                    first_chunk.set()
                return text

        streaming = asyncio.create_task(stream())
        await asyncio.wait_for(first_chunk.wait(), 20)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)

        ready = await _until_draining(url, within_s=5.0)
        assert ready.status_code == 503, ready.text
        body = ready.json()
        assert body["status"] == "draining" and "SIGTERM" in body["reason"]
        assert (body["prefill_healthy"], body["decode_healthy"]) == (1, 1)
        assert (await _ready_on_new_connection(url)).status_code == 503  # and stays so
        assert (await client.get("/health")).status_code == 200  # alive: no restart

        # A new request during the delay is served, on a connection it then closes.
        assert time.monotonic() - sent < DRAIN_S  # sent while draining
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "Hello world!"
        assert resp.headers["connection"] == "close"

        events = sse_events(await streaming)  # the stream in flight at SIGTERM completes
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello world!"
    assert await asyncio.wait_for(proc.wait(), 40) == 0
    assert time.monotonic() - sent >= DRAIN_S  # not before the delay was over
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_signal_cuts_the_drain_short(
    second: int, tiny_model_dir: Path, make_engine: Callable[..., Awaitable[FakeEngine]],
    router_procs: list[asyncio.subprocess.Process],
) -> None:
    p, d = await make_engine(), await make_engine()
    proc, url = await _router(tiny_model_dir, p, d, "--drain-delay-s", "120")
    router_procs.append(proc)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await wait_until_ready(client, proc)
    proc.send_signal(signal.SIGTERM)
    assert (await _until_draining(url, within_s=5.0)).status_code == 503
    proc.send_signal(second)
    assert await asyncio.wait_for(proc.wait(), 30) == 0  # not the 120 s


async def test_sigint_skips_the_drain(
    tiny_model_dir: Path, make_engine: Callable[..., Awaitable[FakeEngine]],
    router_procs: list[asyncio.subprocess.Process],
) -> None:
    """Ctrl-C in a terminal: the graceful shutdown at once, no 120 s of draining."""
    p, d = await make_engine(), await make_engine()
    proc, url = await _router(tiny_model_dir, p, d, "--drain-delay-s", "120")
    router_procs.append(proc)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await wait_until_ready(client, proc)
    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
