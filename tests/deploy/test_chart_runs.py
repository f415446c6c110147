"""The chart's security settings, checked on the real processes: the router and shim
Deployments' rendered args and env (secrets from the rendered Secrets, the pod IP as
127.0.0.1, mounted secret files under a scratch directory) start `pdgate router` and
`pdgate shim`, overriding only where they listen, the model (the tiny built-in one on the
CPU) and the engine URLs (static instead of pod discovery).

A fifth, default values with two router workers, stops the router as Kubernetes does
(SIGTERM, no preStop hook) and checks the drain the chart configures.

Four renders: default values with notify mode and client keys (shim engines); default
values with nothing set ("nokey": the chart generates the client key); values-vllm.yaml
(two models: one on P/D in pull mode, one colocated) and values-vllm.yaml +
values-vllm-push.yaml (its P/D model in push mode), where shims stand in
for vLLM, given the key the vLLM pods get as VLLM_API_KEY (tests/vllm/test_vllm_chart.py
runs these two renders with real vLLM engines). Then: clients need one of the
chart's keys; engines take only the router's key; unsigned or badly signed KV-ready notices
are dropped by the router's proxy; /dashboard and /admin need the admin key; every probe the
chart declares answers without credentials.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
import zmq

from pdgate.proxy.wire import KVReady, to_frames
from tests.deploy.conftest import (
    MONITORING,
    NOTIFY_OVERRIDES,
    VLLM_PUSH_VALUES,
    VLLM_VALUES,
    write_values,
)
from tests.deploy.helm_render import ROOT, Rendered, Renderer
from tests.deploy.pods import Container, realize, secret_value
from tests.drain_probes import wait_for_drain

# A release starts up to three shims at once (values-vllm.yaml: two models); on a 2-core
# machine busy with other tests one shim took 85 s to answer /health, three took over 180.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STARTUP_S = 420.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        series, _, rest = head.partition("{")
        if series == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@dataclass
class Proc:
    name: str
    url: str
    container: Container
    popen: subprocess.Popen[bytes]
    log: Path
    port_map: dict[int, int] = field(default_factory=dict)  # container port -> local port
    model: str = ""  # an engine's (first) served model name

    def tail(self) -> str:
        return f"--- {self.name}\n{self.log.read_text(errors='replace')[-4000:]}"

    def wait(self, path: str, ok: Any, timeout: float = STARTUP_S) -> None:
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, f"{self.name} exited\n{self.tail()}"
            try:
                resp = httpx.get(self.url + path, timeout=2.0)
                last = f"{resp.status_code} {resp.text[:200]}"
                if ok(resp):
                    return
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.3)
        raise AssertionError(f"{self.name}: {path} not ready: {last}\n{self.tail()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            # SIGINT: the graceful shutdown without the router's drain (the chart's 10 s);
            # the drain itself is test_sigterm_drains_for_the_charts_delay_... below.
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start(name: str, entrypoint: list[str], c: Container, overrides: list[str], port: int,
          logs: Path, env: dict[str, str] | None = None) -> Proc:
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "pdgate.cli", *entrypoint, *c.args, *overrides], cwd=ROOT,
            env={**c.process_env(), **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    return Proc(name, f"http://127.0.0.1:{port}", c, popen, log,
                {c.ports.get("http", port): port})


@dataclass
class Deployment:
    """A rendered release running here: router + one prefill and one decode engine."""

    mode: str  # notify / nokey (shim engines), vllm / vllm-push (shims stand in for vLLM)
    rendered: Rendered
    router: Proc
    engines: list[Proc]
    client_keys: list[str]
    engine_key: str
    admin_key: str
    notify_secret: str | None
    notify_endpoint: str | None
    models: list[str]  # the first served name of each model the release serves

    @property
    def model(self) -> str:
        return self.models[0]

    def completion(self, url: str, key: str | None, max_tokens: int = 4,
                   model: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(url + "/v1/completions", headers=headers, timeout=120.0, json={
            "model": model or self.model, "prompt": "Hello world! How are you today?",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def one_container(r: Rendered, suffix: str) -> dict[str, Any]:
    dep = r.one("Deployment", suffix)
    assert len(dep["spec"]["template"]["spec"]["containers"]) == 1
    # No `command`: the image's ENTRYPOINT (`pdgate router` / `pdgate shim`) runs the args.
    assert "command" not in dep["spec"]["template"]["spec"]["containers"][0]
    return dep


def env_secret(r: Rendered, dep: dict[str, Any], var: str) -> str:
    """The value of a secretKeyRef env var of `dep`'s container, from the rendered Secret."""
    for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]:
        if e["name"] == var:
            ref = e["valueFrom"]["secretKeyRef"]
            value = secret_value(r, ref["name"], ref["key"])
            assert value, var
            return value
    raise AssertionError(f"{var} is not set")


def _models(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The rendered router config's models: its `models:` entries, or its one model; each
    with `label`, the pdgate.io/model its pods carry ("" for the one model)."""
    if not config.get("models"):
        return [{"served_model_name": config["served_model_name"],
                 "pd_mode": config.get("pd_mode", "pull"), "label": ""}]
    found = []
    for entry in config["models"]:
        terms = dict(t.split("=", 1) for t in entry["decode_selector"].split(","))
        found.append({**entry, "label": terms["pdgate.io/model"]})
    return found


def _engine_dep(r: Rendered, label: str, role: str) -> dict[str, Any]:
    if not label:
        return r.one("Deployment", f"-{role}")
    return r.one("Deployment", f"-{label}-{role}")


def launch(mode: str, r: Rendered, tmp: Path, tiny: Path) -> Deployment:
    logs = tmp / "logs"
    logs.mkdir()
    router_dep = one_container(r, "-router")
    router_c = realize(r, router_dep, tmp / "router")
    config = yaml.safe_load(Path(router_c.args[router_c.args.index("--config") + 1]).read_text())
    models = _models(config)
    files = {name: Path(v).read_text() for name, v in router_c.env.items()
             if name.endswith("_FILE")}
    engine_key = files["PDGATE_ENGINE_API_KEY_FILE"]
    engines: list[Proc] = []
    router: Proc | None = None
    urls: list[dict[str, list[str]]] = []
    try:
        for m in models:
            roles = ("decode",) if m["pd_mode"] == "colocated" else ("prefill", "decode")
            urls.append({"prefill": [], "decode": []})
            for role in roles:
                engines.append(_start_engine(mode, r, _engine_dep(r, m["label"], role), role,
                                             m, tmp, tiny, logs))
                urls[-1][role].append(engines[-1].url)
        port = free_port()
        overrides = ["--host", "127.0.0.1", "--port", str(port), "--discovery", "static"]
        if config.get("models"):  # each model on its engines here, the tiny tokenizer
            overrides += ["--models", json.dumps([
                {**{k: v for k, v in m.items() if not k.endswith("_selector") and k != "label"},
                 "model": str(tiny), **u} for m, u in zip(models, urls, strict=True)])]
        else:
            overrides += ["--model", str(tiny), "--prefill", engines[0].url,
                          "--decode", engines[1].url]
        notify_endpoint = None
        if config.get("pd_mode") == "notify":
            # Rendered: bind every interface on the declared port, advertise the pod IP.
            assert config["notify_bind"] == f"tcp://0.0.0.0:{router_c.ports['kv-notify']}"
            assert router_c.env["PDGATE_NOTIFY_ADVERTISE_HOST"] == "127.0.0.1"
            notify_endpoint = f"tcp://127.0.0.1:{free_port()}"
            overrides += ["--notify-bind", notify_endpoint]
        router = start("router", ["router"], router_c, overrides, port, logs)
        for e in engines:
            e.wait("/health", lambda resp: resp.status_code == 200)
        router.wait("/ready", lambda resp: resp.status_code == 200 and (
            resp.json().get("prefill_healthy"), resp.json().get("decode_healthy")) == (
            sum(len(u["prefill"]) for u in urls), sum(len(u["decode"]) for u in urls)))
    except BaseException:
        for p in [*engines, *([router] if router else [])]:
            p.stop()
        raise
    return Deployment(
        mode, r, router, engines, files["PDGATE_API_KEYS_FILE"].split(","), engine_key,
        files["PDGATE_ADMIN_API_KEY_FILE"], files.get("PDGATE_NOTIFY_SECRET_FILE"),
        notify_endpoint, [m["served_model_name"][0] for m in models])


def _start_engine(mode: str, r: Rendered, dep: dict[str, Any], role: str,
                  model: dict[str, Any], tmp: Path, tiny: Path, logs: Path) -> Proc:
    port, side = free_port(), free_port()
    name = f"{model['label'] or 'model'}-{role}"
    if mode.startswith("vllm"):
        # vLLM pods get the engine key as VLLM_API_KEY; a shim stands in for vLLM with that
        # key (its PDGATE_ENGINE_API_KEY), serving the same model names.
        key = env_secret(r, dep, "VLLM_API_KEY")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        names = args[args.index("--served-model-name") + 1:args.index("--host")]
        c = Container(role, ["--served-model-name", *names], {}, {"http": port}, {})
        extra = {"PDGATE_ENGINE_API_KEY": key}
    else:
        assert len(dep["spec"]["template"]["spec"]["containers"]) == 1
        assert "command" not in dep["spec"]["template"]["spec"]["containers"][0]
        c = realize(r, dep, tmp / name)
        extra = {}
    proc = start(name, ["shim"], c, [
        "--host", "127.0.0.1", "--port", str(port), "--model", str(tiny),
        "--device", "cpu", "--side-channel-port", str(side)], port, logs, extra)
    proc.model = model["served_model_name"][0]
    return proc


@pytest.fixture(scope="module", params=["notify", "nokey", "vllm", "vllm-push"])
def deployment(request: pytest.FixtureRequest, renderer: Renderer, tiny_model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp(f"release-{request.param}")
    if request.param == "vllm":
        r = renderer.render(VLLM_VALUES, api_versions=MONITORING)
    elif request.param == "vllm-push":
        r = renderer.render(VLLM_VALUES, VLLM_PUSH_VALUES, api_versions=MONITORING)
    elif request.param == "nokey":
        r = renderer.render()  # no client key configured: the chart generates one
    else:
        r = renderer.render(write_values(tmp, NOTIFY_OVERRIDES))
    d = launch(request.param, r, tmp, tiny_model_dir)
    try:
        yield d
    finally:
        for p in [d.router, *d.engines]:
            p.stop()


def test_clients_need_one_of_the_charts_api_keys(deployment: Deployment) -> None:
    d = deployment
    assert len(d.client_keys) >= 1 and all(len(k) >= 8 for k in d.client_keys)
    for key in (None, "wrong-key-123456", d.engine_key, d.admin_key):
        resp = d.completion(d.router.url, key)
        assert resp.status_code == 401, (key, resp.text)
        assert resp.headers["www-authenticate"] == "Bearer"
    resp = httpx.get(d.router.url + "/v1/models", timeout=10.0)
    assert resp.status_code == 401
    for key in d.client_keys:  # every key of the comma-separated list
        resp = d.completion(d.router.url, key)
        assert resp.status_code == 200, f"{resp.text}\n{d.router.tail()}"
        assert resp.json()["usage"]["completion_tokens"] == 4


def test_engines_take_only_the_routers_key(deployment: Deployment) -> None:
    d = deployment
    for e in d.engines:
        for key in (None, "wrong-key-123456", d.client_keys[0]):
            resp = d.completion(e.url, key)
            assert resp.status_code == 401, (e.name, key, resp.text)
        # The KV-control routes the router alone should use.
        for method, path, body in (("POST", "/v1/kv/reserve", {"num_tokens": 16}),
                                   ("POST", "/v1/kv/abort", {"request_id": "x"}),
                                   ("GET", "/debug/kv_transfers", None)):
            resp = httpx.request(method, e.url + path, json=body, timeout=10.0)
            assert resp.status_code == 401, (e.name, path, resp.text)
        resp = d.completion(e.url, d.engine_key, model=e.model)
        assert resp.status_code == 200, f"{resp.text}\n{e.tail()}"
    # The router's requests carry the key: a completion through it for every model the
    # release serves (values-vllm.yaml: two) is served by that model's engines.
    before = [metric(e.url, "pdgate_shim_requests_total") for e in d.engines]
    for model in d.models:
        resp = d.completion(d.router.url, d.client_keys[0], model=model)
        assert resp.status_code == 200, (model, resp.text)
    after = [metric(e.url, "pdgate_shim_requests_total") for e in d.engines]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    if d.mode.startswith("vllm"):
        assert d.models == ["qwen3-8b", "qwen3-0.6b"]
        assert [e.model for e in d.engines] == ["qwen3-8b", "qwen3-8b", "qwen3-0.6b"]


@pytest.mark.parametrize("deployment", ["notify"], indirect=True)  # vLLM: pull, no proxy
def test_unsigned_kv_ready_notices_are_dropped(deployment: Deployment) -> None:
    d = deployment
    assert d.notify_secret and d.notify_endpoint

    def dropped() -> float:
        return metric(d.router.url, "pdgate_proxy_messages_total", result="bad_mac")

    def accepted() -> float:
        return metric(d.router.url, "pdgate_proxy_messages_total", kind="kv_ready", result="ok")

    def received() -> float:
        return metric(d.router.url, "pdgate_proxy_messages_total")

    # A request through the router: P signs its notice with the secret from its own mounted
    # file, the router's proxy accepts it.
    ok = accepted()
    assert d.completion(d.router.url, d.client_keys[0]).status_code == 200
    until(lambda: accepted() >= ok + 1)
    base_dropped = dropped()
    forged = KVReady(request_id="forged-request", engine_id="attacker")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(d.notify_endpoint)
        sock.send_multipart(to_frames(forged))  # no MAC
        sock.send_multipart(to_frames(forged, b"not-the-chart-secret-0123456789"))
        sock.send_multipart([b'{"req_id": "forged-lmcache"}'])  # LMCache style, unsigned
        until(lambda: dropped() >= base_dropped + 3)
        # Signed with the chart's secret, the same notice passes the MAC check (whatever
        # the waiter table then makes of it): the router holds that secret.
        seen = received()
        sock.send_multipart(to_frames(forged, d.notify_secret.encode()))
        until(lambda: received() >= seen + 1)
    finally:
        sock.close()
        ctx.term()
    assert dropped() == base_dropped + 3


def test_dashboard_and_admin_need_the_admin_key(deployment: Deployment) -> None:
    d = deployment
    for path in ("/dashboard", "/dashboard/state", "/admin/engines"):
        for key in (None, d.client_keys[0], d.engine_key):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            resp = httpx.get(d.router.url + path, headers=headers, timeout=10.0)
            assert resp.status_code == 401, (path, key, resp.status_code)
        resp = httpx.get(d.router.url + path, timeout=10.0,
                         headers={"Authorization": f"Bearer {d.admin_key}"})
        assert resp.status_code == 200, (path, resp.text)


def test_probes_and_metrics_answer_without_credentials(deployment: Deployment) -> None:
    d = deployment
    for p in [d.router, *d.engines]:
        probes = p.container.probes
        if d.mode.startswith("vllm") and p is not d.router:
            vllm = d.rendered.one("Deployment", f"-{p.name}")["spec"]["template"]["spec"]
            probes = {k: v for k, v in vllm["containers"][0].items() if k.endswith("Probe")}
        assert {"readinessProbe", "livenessProbe"} <= set(probes), p.name
        for kind, probe in probes.items():
            path = probe["httpGet"]["path"]
            resp = httpx.get(p.url + path, timeout=10.0)
            assert resp.status_code == 200, (p.name, kind, path, resp.status_code)
        # Prometheus (ServiceMonitor / PodMonitor) scrapes without credentials.
        assert httpx.get(p.url + "/metrics", timeout=10.0).status_code == 200


def ready(url: str) -> httpx.Response:
    return httpx.get(url, headers={"Connection": "close"}, timeout=5)


def test_sigterm_drains_for_the_charts_delay_within_its_grace_period(
    renderer: Renderer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Deletion as Kubernetes does it with the chart's pod spec: SIGTERM at once (no preStop
    hook). The readiness probe's path fails within seconds on every worker, a
    completion is still served during the drain, and the router exits 0 after the chart's
    drain delay, inside its grace period."""
    r = renderer.render(write_values(tmp_path, {"router": {"workers": 2}}))
    spec = r.one("Deployment", "-router")["spec"]["template"]["spec"]
    assert "lifecycle" not in spec["containers"][0]
    grace = spec["terminationGracePeriodSeconds"]
    d = launch("nokey", r, tmp_path, tiny_model_dir)
    try:
        config = yaml.safe_load(Path(d.router.container.args[
            d.router.container.args.index("--config") + 1]).read_text())
        drain = config["drain_delay_s"]
        assert config["workers"] == 2 and drain >= 5
        probe = d.router.container.probes["readinessProbe"]["httpGet"]["path"]
        # Both workers ready first: each has answered 200 (a worker whose health checks
        # have not yet seen the engines answers 503 "not ready", which is no drain; and one
        # whose lifespan is not up yet does not listen, so its peer gets every connection).
        seen: set[str] = set()
        deadline = time.monotonic() + 60
        while seen != {"0", "1"}:
            resp = ready(d.router.url + probe)
            if resp.status_code == 200:
                seen.add(resp.headers["x-pdgate-worker"])
            assert time.monotonic() < deadline, f"{probe} not 200 on both workers in 60 s"
        sent = time.monotonic()
        d.router.popen.send_signal(signal.SIGTERM)
        # Every worker's readiness probe fails within 5 s of the signal.
        wait_for_drain(d.router.url + probe, sent)
        resp = d.completion(d.router.url, d.client_keys[0])
        assert resp.status_code == 200, f"{resp.text}\n{d.router.tail()}"
        assert time.monotonic() - sent < drain
        assert d.router.popen.wait(grace) == 0
        assert drain <= time.monotonic() - sent <= grace
    finally:
        for p in [d.router, *d.engines]:
            p.stop()
