"""Kubernetes discovery against a fake API server: a real aiohttp server on loopback that
serves pod LIST and WATCH the way kube-apiserver does (resourceVersions, newline-delimited
watch events, timeoutSeconds, bookmarks, 410 Gone for compacted history)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from pdgate.router.config import ConfigError, ModelConfig, RouterConfig
from pdgate.router.config_checks import validate_config
from pdgate.router.discovery import ApiServer, PodWatcher, WatchSpec
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import POLICIES
from pdgate.router.pool import EndpointPool, Role
from tests.router.conftest import MODEL, serve
from tests.router.fake_engine import FakeEngine

FOLLOW_S = 1.0  # the contract: the engine set follows the pods within a second
NS = "llm"
PREFILL = "app=pdgate,pdgate.io/role=prefill"
DECODE = "app=pdgate,pdgate.io/role=decode"


def make_pod(name: str, role: str, ip: str, *, ready: bool = True, app: str = "pdgate",
             phase: str = "Running") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}",
                     "labels": {"app": app, "pdgate.io/role": role}},
        "spec": {"containers": [{"name": "engine", "image": "pdgate-shim"}]},
        "status": {
            "phase": phase, "podIP": ip if phase == "Running" else None,
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def matches(selector: str, pod: dict[str, Any]) -> bool:
    labels = pod["metadata"].get("labels", {})
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
    return True


class FakeApiServer:
    """Pods in one namespace. Mutations bump the resourceVersion and append a watch event
    to the history; `compact()` forgets the history, so older watches get 410 Gone."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 1000
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest_rv = self.rv  # a watch from an older resourceVersion is 410 Gone
        self.gone_as_event = True  # 410 as an ERROR event (the usual) or as HTTP 410
        self.fail_lists = 0  # answer this many lists with 500 first
        self.lists = 0
        self.watch_rvs: list[str] = []
        self.watch_timeouts: list[str] = []
        self._changed = asyncio.Condition()
        self._drops = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(f"/api/v1/namespaces/{NS}/pods", self._pods)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock, shutdown_timeout=0.1).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        await self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _record(self, kind: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod = json.loads(json.dumps(pod))
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, kind, pod))
        async with self._changed:
            self._changed.notify_all()

    async def put(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        self.pods[name] = pod
        await self._record(kind, pod)

    async def delete(self, name: str) -> None:
        await self._record("DELETED", self.pods.pop(name))

    async def bookmark(self) -> None:
        await self._record("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {}})

    def compact(self) -> None:
        self.history.clear()
        self.oldest_rv = self.rv

    async def drop_watches(self) -> None:
        """Cut every open watch connection without ending the stream properly."""
        self._drops += 1
        async with self._changed:
            self._changed.notify_all()

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request)
        self.lists += 1
        if self.fail_lists > 0:
            self.fail_lists -= 1
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        selector = request.query.get("labelSelector", "")
        items = [p for p in self.pods.values() if matches(selector, p)]
        return web.json_response({
            "kind": "PodList", "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.rv)}, "items": items,
        })

    async def _watch(self, request: web.Request) -> web.StreamResponse:
        rv_text = request.query.get("resourceVersion", "")
        self.watch_rvs.append(rv_text)
        self.watch_timeouts.append(request.query.get("timeoutSeconds", ""))
        sent = int(rv_text) if rv_text else self.rv
        if sent < self.oldest_rv:
            gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                    "reason": "Expired", "message": f"too old resource version: {sent}"}
            if not self.gone_as_event:
                return web.json_response(gone, status=410)
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        timeout = float(request.query.get("timeoutSeconds", "300"))
        deadline = asyncio.get_running_loop().time() + timeout
        selector = request.query.get("labelSelector", "")
        drops = self._drops
        while True:
            for erv, kind, obj in list(self.history):
                if erv > sent and (kind == "BOOKMARK" or matches(selector, obj)):
                    await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                sent = max(sent, erv)
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return resp  # a clean end of the stream, as after timeoutSeconds
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
            if self._drops != drops:
                if request.transport is not None:  # None: the client already left
                    request.transport.abort()
                return resp


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    yield server
    await server.stop()


Watch = Callable[..., PodWatcher]


@pytest.fixture
async def pool() -> EndpointPool:
    return EndpointPool([], [], RouterMetrics.create(CollectorRegistry()))


@pytest.fixture
async def watch(api: FakeApiServer, pool: EndpointPool) -> AsyncIterator[Watch]:
    """Start a PodWatcher task for a role (cancelled at teardown)."""
    tasks: list[asyncio.Task[None]] = []
    async with httpx.AsyncClient() as session:

        def start(role: Role = "prefill", selector: str = PREFILL, **kw: Any) -> PodWatcher:
            w = PodWatcher(session, ApiServer(api.url, NS), WatchSpec(role, selector, 8100),
                           pool, **kw)
            tasks.append(asyncio.create_task(w.run()))
            return w

        yield start
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def urls(pool: EndpointPool, role: Role) -> set[str]:
    return {ep.url for ep in pool.endpoints(role)}


async def follows(pool: EndpointPool, role: Role, expected: set[str]) -> None:
    """Wait until the pool's `role` engines are `expected`; fail after FOLLOW_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FOLLOW_S
    while urls(pool, role) != expected:
        if loop.time() > deadline:
            pytest.fail(f"{role} engines {urls(pool, role)} != {expected} after {FOLLOW_S}s")
        await asyncio.sleep(0.005)


async def test_pods_appear_become_ready_and_disappear(
    api: FakeApiServer, pool: EndpointPool, watch: Watch
) -> None:
    await api.put(make_pod("p0", "prefill", "10.0.0.1"))
    await api.put(make_pod("p1", "prefill", "10.0.0.2", ready=False))
    await api.put(make_pod("d0", "decode", "10.0.1.1"))
    await api.put(make_pod("other", "prefill", "10.0.9.9", app="someone-else"))
    await api.put(make_pod("p2", "prefill", "", phase="Pending"))
    w = watch()
    await asyncio.wait_for(w.synced.wait(), FOLLOW_S)
    assert urls(pool, "prefill") == {"http://10.0.0.1:8100"}
    assert urls(pool, "decode") == set()  # another watcher's role

    await api.put(make_pod("p1", "prefill", "10.0.0.2"))  # becomes ready
    await follows(pool, "prefill", {"http://10.0.0.1:8100", "http://10.0.0.2:8100"})

    await api.put(make_pod("p3", "prefill", "10.0.0.3"))  # appears ready
    await follows(pool, "prefill", {"http://10.0.0.1:8100", "http://10.0.0.2:8100",
                                    "http://10.0.0.3:8100"})

    await api.put(make_pod("p0", "prefill", "10.0.0.1", ready=False))  # fails readiness
    await follows(pool, "prefill", {"http://10.0.0.2:8100", "http://10.0.0.3:8100"})

    await api.delete("p1")
    await follows(pool, "prefill", {"http://10.0.0.3:8100"})

    terminating = make_pod("p3", "prefill", "10.0.0.3")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await api.put(terminating)  # graceful deletion starts: no new requests
    await follows(pool, "prefill", set())
    assert api.lists == 1, "plain events must not cause a relist"


async def test_removed_pod_drains_its_in_flight_requests(
    api: FakeApiServer, pool: EndpointPool, watch: Watch
) -> None:
    await api.put(make_pod("p0", "prefill", "10.0.0.1"))
    await api.put(make_pod("p1", "prefill", "10.0.0.2"))
    watch()
    await follows(pool, "prefill", {"http://10.0.0.1:8100", "http://10.0.0.2:8100"})
    ep = next(e for e in pool.endpoints("prefill") if e.url.endswith("10.0.0.1:8100"))
    with pool.track(ep):
        await api.delete("p0")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FOLLOW_S
        while not ep.draining:
            assert loop.time() < deadline, "deleted pod was not drained"
            await asyncio.sleep(0.005)
        assert ep in pool.endpoints("prefill"), "drained while a request was in flight"
        assert [e.url for e in pool.healthy("prefill")] == ["http://10.0.0.2:8100"]
    assert urls(pool, "prefill") == {"http://10.0.0.2:8100"}


async def test_dropped_watch_resumes_from_last_resource_version(
    api: FakeApiServer, pool: EndpointPool, watch: Watch
) -> None:
    await api.put(make_pod("p0", "prefill", "10.0.0.1"))
    watch()
    await follows(pool, "prefill", {"http://10.0.0.1:8100"})
    await api.put(make_pod("p1", "prefill", "10.0.0.2"))
    await follows(pool, "prefill", {"http://10.0.0.1:8100", "http://10.0.0.2:8100"})
    seen_rv = str(api.rv)

    await api.drop_watches()
    await api.delete("p0")  # happens while no watch is connected
    await follows(pool, "prefill", {"http://10.0.0.2:8100"})
    assert api.lists == 1, "a dropped watch must resume, not relist"
    assert api.watch_rvs[-1] == seen_rv

    await api.put(make_pod("p2", "prefill", "10.0.0.3"))  # the resumed watch still works
    await follows(pool, "prefill", {"http://10.0.0.2:8100", "http://10.0.0.3:8100"})


async def test_watch_timeout_ends_stream_and_watch_restarts(
    api: FakeApiServer, pool: EndpointPool, watch: Watch
) -> None:
    watch(watch_timeout_s=1)
    await follows(pool, "prefill", set())
    await asyncio.sleep(1.2)  # the server ends the first stream after timeoutSeconds=1
    assert len(api.watch_rvs) >= 2 and api.watch_timeouts[0] == "1"
    await api.put(make_pod("p0", "prefill", "10.0.0.1"))
    await follows(pool, "prefill", {"http://10.0.0.1:8100"})
    assert api.lists == 1


@pytest.mark.parametrize("gone_as_event", [True, False], ids=["error-event", "http-410"])
async def test_expired_resource_version_relists(
    api: FakeApiServer, pool: EndpointPool, watch: Watch, gone_as_event: bool
) -> None:
    api.gone_as_event = gone_as_event
    await api.put(make_pod("p0", "prefill", "10.0.0.1"))
    await api.put(make_pod("p1", "prefill", "10.0.0.2"))
    watch()
    await follows(pool, "prefill", {"http://10.0.0.1:8100", "http://10.0.0.2:8100"})

    await api.drop_watches()
    await api.delete("p0")
    await api.put(make_pod("p2", "prefill", "10.0.0.3"))
    api.compact()  # those events are gone: the watcher's resourceVersion is too old now
    await follows(pool, "prefill", {"http://10.0.0.2:8100", "http://10.0.0.3:8100"})
    assert api.lists == 2
    await api.put(make_pod("p1", "prefill", "10.0.0.2", ready=False))  # watching again
    await follows(pool, "prefill", {"http://10.0.0.3:8100"})


async def test_bookmark_advances_resource_version(
    api: FakeApiServer, pool: EndpointPool, watch: Watch
) -> None:
    await api.put(make_pod("p0", "prefill", "10.0.0.1"))
    watch()
    await follows(pool, "prefill", {"http://10.0.0.1:8100"})
    await api.put(make_pod("x", "decode", "10.0.1.1"))  # not ours: only a bookmark tells
    await api.bookmark()
    await asyncio.sleep(0.2)
    api.compact()
    await api.drop_watches()
    await api.put(make_pod("p1", "prefill", "10.0.0.2"))
    await follows(pool, "prefill", {"http://10.0.0.1:8100", "http://10.0.0.2:8100"})
    assert api.lists == 1, "resuming from the bookmark's resourceVersion needs no relist"


async def test_list_errors_are_retried(
    api: FakeApiServer, pool: EndpointPool, watch: Watch
) -> None:
    api.fail_lists = 2
    await api.put(make_pod("p0", "prefill", "10.0.0.1"))
    w = watch(backoff_s=0.05)
    await follows(pool, "prefill", {"http://10.0.0.1:8100"})
    assert w.synced.is_set() and api.lists == 3


def test_in_cluster_settings(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "ca.crt").write_text("cert")
    (tmp_path / "namespace").write_text("serving\n")
    config = RouterConfig(model="m", discovery="k8s", prefill_selector="a=b",
                          decode_selector="a=c")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    api = ApiServer.resolve(config, env, tmp_path)
    assert api == ApiServer("https://10.96.0.1:443", "serving", tmp_path / "token",
                            tmp_path / "ca.crt")
    with pytest.raises(ConfigError, match="^k8s_api_url:"):
        ApiServer.resolve(config, {}, tmp_path)
    local = ApiServer.resolve(
        RouterConfig(model="m", discovery="k8s", prefill_selector="a=b", decode_selector="c=d",
                     namespace="other", k8s_api_url="http://127.0.0.1:8001"), {}, tmp_path)
    assert local == ApiServer("http://127.0.0.1:8001", "other", None, None)


def test_k8s_discovery_needs_selectors_not_urls() -> None:
    names = frozenset(POLICIES)
    ok = RouterConfig(model="m", discovery="k8s", prefill_selector="a=b", decode_selector="c=d")
    assert validate_config(ok, names) is ok
    with pytest.raises(ConfigError, match="^decode_selector:"):
        validate_config(RouterConfig(model="m", discovery="k8s", prefill_selector="a=b"), names)
    with pytest.raises(ConfigError, match="^prefill:"):
        validate_config(RouterConfig(model="m"), names)


async def test_router_routes_to_discovered_pods(
    api: FakeApiServer, make_engine: Callable[..., Any], tiny_model_dir: Path,
    tokenizer: Any,
) -> None:
    """The whole router with `--discovery k8s`: not ready until pods show up, then serves."""
    p: FakeEngine = await make_engine(engine_id="P0")
    d: FakeEngine = await make_engine(engine_id="D0")
    config = RouterConfig(
        model=str(tiny_model_dir), served_model_name=[MODEL], discovery="k8s", namespace=NS,
        k8s_api_url=api.url, prefill_selector=PREFILL, decode_selector=DECODE,
        prefill_port=int(p.url.rsplit(":", 1)[1]), decode_port=int(d.url.rsplit(":", 1)[1]),
        health_interval_s=3600.0,
    )
    async with serve(config, tokenizer) as router:
        assert (await router.client.get("/ready")).status_code == 503
        await api.put(make_pod("prefill-0", "prefill", "127.0.0.1"))
        await api.put(make_pod("decode-0", "decode", "127.0.0.1"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FOLLOW_S
        while (await router.client.get("/ready")).status_code != 200:
            assert loop.time() < deadline, "router did not pick up the pods"
            await asyncio.sleep(0.01)
        reply = await router.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert reply.status_code == 200
        assert reply.headers["X-Pdgate-Prefill-Engine"] == p.url
        assert reply.headers["X-Pdgate-Decode-Engine"] == d.url
        assert len(p.prefills) == 1 and len(d.decodes) == 1


# --- EndpointPool membership (what discovery and the admin API build on) ---------------

def test_pool_add_is_idempotent_and_new_endpoints_take_traffic() -> None:
    registry = CollectorRegistry()
    pool = EndpointPool(["http://p0:1"], ["http://d0:1"], RouterMetrics.create(registry))
    ep = pool.add("http://p1:1/", "prefill")
    assert pool.add("http://p1:1", "prefill") is ep
    assert [e.url for e in pool.healthy("prefill")] == ["http://p0:1", "http://p1:1"]
    assert ep.index == 1 and pool.add("http://p2:1", "prefill").index == 2
    assert registry.get_sample_value(
        "pdgate_engine_healthy", {"engine": "http://p1:1", "role": "prefill"}) == 1


def test_pool_remove_and_drain() -> None:
    registry = CollectorRegistry()
    pool = EndpointPool(["http://p0:1", "http://p1:1"], ["http://d0:1"],
                        RouterMetrics.create(registry))
    assert pool.remove("http://p0:1") and not pool.remove("http://p0:1")
    assert registry.get_sample_value(
        "pdgate_engine_healthy", {"engine": "http://p0:1", "role": "prefill"}) is None
    d0 = pool.endpoints("decode")[0]
    with pool.track(d0):
        assert pool.drain("http://d0:1")
        assert pool.endpoints("decode") == [d0] and pool.healthy("decode") == []
        assert not pool.ready()
    assert pool.endpoints("decode") == []  # the last in-flight request finished
    p1 = pool.endpoints("prefill")[0]
    with pool.track(p1):
        pool.drain("http://p1:1")
        assert pool.add("http://p1:1", "prefill") is p1  # taken back before it left
    assert pool.healthy("prefill") == [p1] and not p1.draining
    assert pool.drain("http://p1:1") and pool.endpoints("prefill") == []  # idle: at once
    assert not pool.drain("http://nowhere:1")


async def test_each_model_finds_its_pods_by_their_model_label(
    api: FakeApiServer, make_engine: Callable[..., Any], tokenizer: Any,
) -> None:
    """Two models under `models:` with `discovery: k8s` and no selectors: each model's pool
    is the ready pods labelled with its name and role (router/config.py `model_configs`)."""
    p, d, other = [await make_engine(engine_id=n) for n in ("P", "D", "B")]

    def port(engine: FakeEngine) -> int:
        return int(engine.url.rsplit(":", 1)[1])

    config = RouterConfig(discovery="k8s", namespace=NS, k8s_api_url=api.url,
                          health_interval_s=3600.0, models=[
        ModelConfig(model="alpha", prefill_port=port(p), decode_port=port(d)),
        ModelConfig(model="beta", pd_mode="colocated", decode_port=port(other)),
    ])

    def pod(name: str, role: str, model: str) -> dict[str, Any]:
        made = make_pod(name, role, "127.0.0.1")
        made["metadata"]["labels"]["pdgate.io/model"] = model
        return made

    async with serve(config, tokenizer) as router:
        assert (await router.client.get("/ready")).status_code == 503
        await api.put(pod("alpha-prefill-0", "prefill", "alpha"))
        await api.put(pod("alpha-decode-0", "decode", "alpha"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FOLLOW_S
        while (await router.client.get("/ready?model=alpha")).status_code != 200:
            assert loop.time() < deadline, "alpha's pods not picked up"
            await asyncio.sleep(0.01)
        beta = await router.client.get("/ready?model=beta")
        assert beta.status_code == 503 and beta.json()["models"]["beta"]["decode_healthy"] == 0
        await api.put(pod("beta-decode-0", "decode", "beta"))
        while (await router.client.get("/ready")).status_code != 200:
            assert loop.time() < deadline + FOLLOW_S, "beta's pod not picked up"
            await asyncio.sleep(0.01)
        for model, engine in (("alpha", d), ("beta", other)):
            reply = await router.client.post(
                "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3})
            assert reply.status_code == 200, reply.text
            assert reply.headers["X-Pdgate-Decode-Engine"] == engine.url
        assert len(p.prefills) == 1 and [len(d.decodes), len(other.decodes)] == [1, 1]
