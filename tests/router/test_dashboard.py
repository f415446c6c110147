"""The /dashboard status page: its JSON state, the recent-TTFT window, and the page itself
loaded in a real headless Chromium driven over the DevTools protocol (aiohttp websocket)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Histogram

from router import __version__
from router.dashboard import HistogramWindow, History
from router.metrics import RouterMetrics
from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_recent_ttft_window_forgets_old_requests() -> None:
    hist = Histogram("t_seconds", "t", ["mode"], buckets=(0.1, 0.2, 0.4, 0.8),
                     registry=CollectorRegistry())
    clock = Clock()
    window = HistogramWindow(hist, window_s=60.0, clock=clock)
    assert window.recent().count == 0 and window.recent().p50_s is None
    for value in (0.15, 0.15, 0.15, 0.7):
        hist.labels("disagg").observe(value)
    hist.labels("decode-only").observe(0.15)
    now = window.recent()
    assert now.count == 5 and now.mean_s == pytest.approx((0.15 * 4 + 0.7) / 5)
    assert 0.1 < (now.p50_s or 0) <= 0.2 and 0.4 < (now.p95_s or 0) <= 0.8
    clock.now += 61  # those requests leave the window
    assert window.recent().count == 0
    hist.labels("disagg").observe(0.3)
    clock.now += 1
    later = window.recent()
    assert later.count == 1 and later.mean_s == pytest.approx(0.3)
    assert 0.2 < (later.p50_s or 0) <= 0.4


async def completion(router: RunningRouter) -> None:
    reply = await router.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                 "stream": True})
    assert reply.status_code == 200


@pytest.fixture
async def cluster(make_engine: MakeEngine, start_router: StartRouter) -> RunningRouter:
    """Two prefill engines (one failing its health check) and one decode engine. Whether
    the router already counts that one as unhealthy is the health checker's business; the
    page must show whatever the pool says."""
    p0 = await make_engine(engine_id="P0")
    p1 = await make_engine(engine_id="P1", health_status=500)
    d0 = await make_engine(engine_id="D0")
    router = await start_router([p0, p1], [d0])
    await completion(router)
    return router


async def test_state_lists_engines_and_recent_ttft(cluster: RunningRouter) -> None:
    state = (await cluster.client.get("/dashboard/state")).json()
    assert state["ready"] is True and state["discovery"] == "static"
    engines = {(e["role"], e["url"]): (e["healthy"], e["in_flight"], e["draining"])
               for e in state["engines"]}
    cfg = cluster.config
    assert set(engines) == {("prefill", cfg.prefill[0]), ("prefill", cfg.prefill[1]),
                            ("decode", cfg.decode[0])}
    assert engines[("decode", cfg.decode[0])] == (True, 0, False)
    assert all(in_flight == 0 and not draining for _, in_flight, draining in engines.values())
    assert state["ttft"]["count"] == 1 and state["ttft"]["p50_s"] > 0
    assert state["version"] == __version__ and state["mode"] == "pull"
    assert state["policies"] == {"prefill": cfg.prefill_policy, "decode": cfg.decode_policy}
    assert all(e["breaker"] == "closed" for e in state["engines"])
    assert {e["status"] for e in state["engines"]} <= {"healthy", "unhealthy"}
    page = await cluster.client.get("/dashboard")
    assert page.headers["content-type"].startswith("text/html")
    assert "<script" in page.text and "src=" not in page.text  # no external assets


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    reason = "chromium is not installed (apt-get install chromium; .ci/run installs it)"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


class DevTools:
    """A minimal Chrome DevTools Protocol client on one page target."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._next = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            data = json.loads(msg.data)
            if "id" in data:
                self._pending.pop(data["id"]).set_result(data)
            else:
                self.events.append(data)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[self._next] = future
        await self._ws.send_json({"id": self._next, "method": method, "params": params})
        reply = await asyncio.wait_for(future, 30)
        assert "error" not in reply, reply
        result: dict[str, Any] = reply["result"]
        return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    def errors(self) -> list[str]:
        found = []
        for e in self.events:
            method, params = e["method"], e.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params["exceptionDetails"])[:300])
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                found.append(json.dumps(params["args"])[:300])
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(params["entry"]["text"])
        return found


@contextlib.asynccontextmanager
async def browser(tmp_path: Path) -> AsyncIterator[DevTools]:
    """Headless Chromium with remote debugging on a free port; yields its first page."""
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [chromium_binary(), "--headless=new", "--no-sandbox", "--disable-gpu",
         "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        for _ in range(600):
            if port_file.is_file() and port_file.read_text().count("\n") >= 1:
                break
            assert proc.poll() is None, "chromium exited at start"
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().splitlines()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as reply:
                targets = await reply.json()
            page = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                tools = DevTools(ws)
                try:
                    for domain in ("Runtime", "Log", "Page"):
                        await tools.call(f"{domain}.enable")
                    yield tools
                finally:
                    await tools.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_page_shows_the_engines_in_a_real_browser(
    cluster: RunningRouter, tmp_path: Path
) -> None:
    state = (await cluster.client.get("/dashboard/state")).json()
    expected = sorted(
        [e["role"], e["url"], e["status"], "closed", "0", str(e["consecutive_errors"]), "-"]
        for e in state["engines"])
    async with browser(tmp_path) as page:
        await page.call("Page.navigate", url=f"{cluster.url}/dashboard")
        for _ in range(200):
            if await page.evaluate("document.body && document.body.dataset.loaded") == "true":
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the page never rendered the state; errors: {page.errors()}")
        rows = await page.evaluate(
            "[...document.querySelectorAll('#engines tr')]"
            ".map(r => [...r.cells].map(c => c.textContent))")
        status = await page.evaluate("document.getElementById('ready').textContent")
        ttft = await page.evaluate("document.getElementById('ttft-label').textContent")
        about = await page.evaluate("document.getElementById('about').textContent")
        await page.call("Page.reload")  # a second load: still no errors
        await asyncio.sleep(0.3)
        shot = await page.call("Page.captureScreenshot", format="png")
        errors = page.errors()
    assert sorted(rows) == expected and len(rows) == 3
    assert status == "ready" and "(1 req)" in ttft
    assert f"version {__version__}" in about and "mode pull" in about
    assert errors == [], errors
    assert shot["data"]  # the page painted


def test_history_keeps_five_minutes_of_rates() -> None:
    metrics = RouterMetrics.create(CollectorRegistry())
    clock = Clock()
    history = History(span_s=300.0, every_s=5.0, clock=clock)
    history.sample(metrics, in_flight=0)
    assert not history.points and not history.due()
    for status, n in (("200", 20), ("429", 5), ("502", 2), ("499", 3)):
        metrics.child(metrics.requests, "/v1/completions", status).inc(n)
    metrics.observe_usage("tiny", {"prompt_tokens": 40, "completion_tokens": 100})
    clock.now += 10
    assert history.due()
    history.sample(metrics, in_flight=4)
    point = history.points[-1]
    # 30 answers in 10 s: 2 errors (the 499s are clients that left, the 429s refusals).
    assert (point.requests, point.errors, point.rejected, point.tokens, point.in_flight) == (
        3.0, 0.2, 0.5, 10.0, 4)
    for _ in range(70):  # 350 s more: the oldest points leave the window
        clock.now += 5
        history.sample(metrics, in_flight=0)
    assert history.points[0].t == clock.now - 300 and len(history.points) == 61
    assert history.points[-1].requests == 0.0


async def test_an_engine_with_an_open_breaker_is_not_shown_healthy(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    """P1 passes every health check but fails its requests: its breaker opens, and the page
    must say so rather than "healthy"."""
    p0 = await make_engine(engine_id="P0")
    p1 = await make_engine(engine_id="P1", fail_status=503)
    d0 = await make_engine(engine_id="D0")
    router = await start_router([p0, p1], [d0], prefill_policy="round-robin",
                                eject_consecutive_errors=1, breaker_open_s=600.0)
    for _ in range(2):
        await completion(router)
    assert p1.requests, "round-robin never sent P1 a request"
    state = (await router.client.get("/dashboard/state")).json()
    by_url = {e["url"]: e for e in state["engines"]}
    bad = by_url[p1.url]
    assert (bad["status"], bad["breaker"], bad["healthy"]) == ("breaker open", "open", True)
    assert by_url[p0.url]["status"] == "healthy"
    assert state["now"] is None or state["now"]["errors"] == 0  # retried: clients saw 200s
