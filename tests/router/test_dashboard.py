"""The /dashboard status page: its JSON state, the recent-TTFT window, and the page itself
loaded in a real headless Chromium driven over the DevTools protocol (aiohttp websocket),
which also saves a screenshot of it (`dashboard.png` in the test's tmp dir)."""

from __future__ import annotations

import asyncio
import base64
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

from pdgate.router import __version__
from pdgate.router.http.dashboard import HistogramWindow, History
from pdgate.router.metrics import RouterMetrics
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
                                 "stream": True, "stream_options": {"include_usage": True}})
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
    reason = "chromium is not installed (apt-get install chromium; make test does as root)"
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


@pytest.fixture
async def busy(make_engine: MakeEngine, start_router: StartRouter) -> RunningRouter:
    """Traffic the page has something to show for: round-robin over P0 (hands its KV to
    decode) and P1 (answers without KV params, so decode recomputes: a fallback)."""
    p0 = await make_engine(engine_id="P0")
    p1 = await make_engine(engine_id="P1", return_kv_params=False)
    d0 = await make_engine(engine_id="D0")
    router = await start_router([p0, p1], [d0], prefill_policy="round-robin")
    for _ in range(4):
        await completion(router)
    assert len(p0.requests) == len(p1.requests) == 2
    return router


TEXTS = "[...document.querySelectorAll('{}')].map(e => e.textContent)"
TABLE = ("[...document.querySelectorAll('{} tr')]"
         ".map(r => [...r.cells].map(c => c.textContent))")
# Each history chart's title and the y values of its line ([] while no point is drawn).
CHARTS = ("[...document.querySelectorAll('.chart')].map(c => [c.querySelector('.label')"
          ".textContent, (c.querySelector('polyline')?.getAttribute('points') ?? '')"
          ".split(' ').filter(Boolean).map(xy => 68 - Number(xy.split(',')[1]))])")


async def test_page_shows_engines_charts_and_tables_in_a_real_browser(
    busy: RunningRouter, tmp_path: Path
) -> None:
    state = (await busy.client.get("/dashboard/state")).json()
    assert state["kv"]["kv_transfers"] == 2 and state["kv"]["fallbacks"] == {"no_kv_params": 2}
    expected = sorted([e["role"], e["url"], "healthy", "closed", "0", "0", "-", MODEL, "-",
                       "-"]
                      for e in state["engines"])
    async with browser(tmp_path) as page:
        await page.call("Emulation.setDeviceMetricsOverride", width=1280, height=900,
                        deviceScaleFactor=1, mobile=False)
        await page.call("Page.navigate", url=f"{busy.url}/dashboard")
        for _ in range(200):
            if await page.evaluate("document.body && document.body.dataset.loaded") == "true":
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the page never rendered the state; errors: {page.errors()}")
        first_about = await page.evaluate("document.getElementById('about').textContent")
        # The router samples its counters every 5 s: the page, refreshing itself, draws
        # the first interval (which holds the 4 requests) once the sampler took it.
        for _ in range(300):
            charts = dict(await page.evaluate(CHARTS))
            if charts and all(charts.values()):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"no history drawn: {charts}; errors: {page.errors()}")
        for _ in range(200):  # it refreshes itself: "up N s" moves on without a reload
            about = await page.evaluate("document.getElementById('about').textContent")
            if about != first_about:
                break
            await asyncio.sleep(0.05)
        engines = await page.evaluate(TABLE.format("#engines"))
        kv = await page.evaluate(TABLE.format("#kv"))
        fallbacks = await page.evaluate(TABLE.format("#fallbacks"))
        cards = dict(zip(await page.evaluate(TEXTS.format(".card .label")),
                         await page.evaluate(TEXTS.format(".card .value")), strict=True))
        title, ttft = [await page.evaluate(f"document.getElementById('{id}').textContent")
                       for id in ("history-title", "ttft-label")]
        shot = base64.b64decode((await page.call(
            "Page.captureScreenshot", format="png", captureBeyondViewport=True))["data"])
        await page.call("Page.reload")  # a second load: still no errors
        await asyncio.sleep(0.3)
        errors = page.errors()
    assert sorted(engines) == expected and len(engines) == 3
    assert cards["Status"] == "ready" and "(4 streams)" in ttft and "from arrival" in ttft
    assert f"version {__version__}" in about and "mode pull" in about
    assert about != first_about, about
    assert title == "Last 15 minutes"
    titles = [t.split(" (")[0] for t in charts]
    assert titles == ["requests / s", "errors / s", "429 / s", "tokens / s",
                      "KV transfers / s", "fallbacks / s"]
    # Requests, KV transfers and fallbacks happened: their lines rise off the baseline;
    # no errors or 429s: flat on it.
    peaks = {t.split(" (")[0]: max(ys) for t, ys in charts.items()}
    assert all(peaks[t] > 60 for t in ("requests / s", "tokens / s", "KV transfers / s",
                                       "fallbacks / s"))
    assert peaks["errors / s"] == peaks["429 / s"] == 0
    assert ["KV transfers (prefill legs that handed KV to decode)", "2"] in kv
    assert fallbacks == [["no_kv_params", "2"]]
    # The latest interval's rates (0 if the traffic fell in an earlier one).
    assert all(float(cards[c]) >= 0 for c in ("KV transfers / s", "Fallbacks / s"))
    assert errors == [], errors
    (tmp_path / "dashboard.png").write_bytes(shot)
    assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 20_000, len(shot)


def test_history_keeps_fifteen_minutes_of_rates() -> None:
    metrics = RouterMetrics.create(CollectorRegistry())
    clock = Clock()
    history = History(clock=clock)
    assert (history.span_s, history.every_s) == (900.0, 5.0)
    history.sample(metrics, in_flight=0)
    assert not history.points and not history.due()
    for status, n in (("200", 20), ("429", 5), ("502", 2), ("499", 3)):
        metrics.child(metrics.requests, "/v1/completions", status).inc(n)
    metrics.observe_usage("tiny", {"prompt_tokens": 40, "completion_tokens": 100})
    for _ in range(6):  # 6 prefill legs: 1 handed decode no KV, 1 ran before a pull
        metrics.prefill_duration.observe(0.01)
    for reason in ("no_kv_params", "no_push", "no_prefill"):
        metrics.count_fallback(reason)
    clock.now += 10
    assert history.due()
    history.sample(metrics, in_flight=4)
    point = history.points[-1]
    # 30 answers in 10 s: 2 errors (the 499s are clients that left, the 429s refusals);
    # 5 legs handed their KV on (no_push switched to the pull flow, which transfers KV).
    assert (point.requests, point.errors, point.rejected, point.tokens, point.in_flight,
            point.kv_transfers, point.fallbacks) == (3.0, 0.2, 0.5, 10.0, 4, 0.5, 0.3)
    for _ in range(190):  # 950 s more: the oldest points leave the window
        clock.now += 5
        history.sample(metrics, in_flight=0)
    assert history.points[0].t == clock.now - 900 and len(history.points) == 181
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
