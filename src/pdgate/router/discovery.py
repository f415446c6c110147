"""Kubernetes engine discovery: keep the pool's engines equal to the ready pods by label.

Each model of the router runs its own discovery with its own selectors; under `models:`
they default to the pods' `pdgate.io/role` and `pdgate.io/model` labels (router/config.py
`model_configs`), so one Deployment per model and role is found by its labels alone.

One `PodWatcher` per role does what a client-go reflector does, over plain HTTP (httpx,
the router's control-plane client; no kubernetes client library):

1. LIST `/api/v1/namespaces/{ns}/pods?labelSelector=...` and reconcile: ready pods are
   `EndpointPool.add`ed, known pods that are gone or no longer ready are `drain`ed (they
   finish their in-flight requests, then leave the pool).
2. WATCH from the list's `resourceVersion` and apply each ADDED / MODIFIED / DELETED event;
   BOOKMARK events only advance the resourceVersion.
3. When the server ends the stream (its `timeoutSeconds`) or the connection drops, watch
   again from the last resourceVersion seen, so nothing is missed or replayed.
4. When the server says that resourceVersion is too old (HTTP 410, or an ERROR event whose
   Status code is 410), list again from scratch (step 1).
5. Any other failure (API server down, 5xx, bad JSON): retry with a capped backoff.

A pod is *ready* when it is Running, has a pod IP, its `Ready` condition is True and it is
not being deleted; its engine URL is `{scheme}://{podIP}:{port}`. Everything runs on the
event loop; the only file reads (service-account token, CA) go through a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec

from pdgate.router.config import ConfigError, RouterConfig
from pdgate.router.pool import EndpointPool, Role

__all__ = ["DP_SIZE_LABEL", "ApiServer", "KubernetesDiscovery", "PodWatcher", "WatchSpec",
           "pod_dp_size", "pod_url"]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# A pod label giving the number of DP ranks behind the pod's engine URL (vLLM
# --data-parallel-size N with internal load balancing); absent: the role's --*-dp-size.
DP_SIZE_LABEL = "pdgate.io/dp-size"
_MAX_BACKOFF_S = 5.0


class _Condition(msgspec.Struct):
    type: str
    status: str


class _PodStatus(msgspec.Struct):
    phase: str = ""
    podIP: str | None = None  # noqa: N815 (the API's field name)
    conditions: list[_Condition] = []


class _ObjectMeta(msgspec.Struct):
    name: str = ""
    labels: dict[str, str] = {}
    resourceVersion: str = ""  # noqa: N815
    deletionTimestamp: str | None = None  # noqa: N815


class _Pod(msgspec.Struct):
    metadata: _ObjectMeta
    status: _PodStatus = msgspec.field(default_factory=_PodStatus)


class _PodList(msgspec.Struct):
    metadata: _ObjectMeta
    items: list[_Pod] = []


class _WatchEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


class _Status(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


class _Expired(Exception):
    """The resourceVersion we watch from is too old (410 Gone): list again."""


class _ApiError(Exception):
    """The API server answered something other than what we asked for."""


_TRANSIENT = (httpx.HTTPError, TimeoutError, _ApiError, msgspec.DecodeError, OSError)


@dataclass(frozen=True)
class WatchSpec:
    """Which pods make up one role's engines, and how their URL is formed."""

    role: Role
    selector: str
    port: int
    scheme: str = "http"


def pod_url(pod: _Pod, spec: WatchSpec) -> str | None:
    """The engine URL of `pod` if it may take requests now, else None."""
    st = pod.status
    if pod.metadata.deletionTimestamp is not None or st.phase != "Running" or not st.podIP:
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in st.conditions):
        return None
    host = f"[{st.podIP}]" if ":" in st.podIP else st.podIP
    return f"{spec.scheme}://{host}:{spec.port}"


def pod_dp_size(pod: _Pod) -> int | None:
    """The pod's `DP_SIZE_LABEL` as a positive int; None when absent or malformed (the
    role's default then applies; a malformed value is logged)."""
    value = pod.metadata.labels.get(DP_SIZE_LABEL)
    if value is None:
        return None
    if value.isdigit() and int(value) >= 1:
        return int(value)
    log.warning("pod %s: label %s=%r is not a positive integer (ignored)",
                pod.metadata.name, DP_SIZE_LABEL, value)
    return None


@dataclass(frozen=True)
class ApiServer:
    """Where the Kubernetes API is and how to authenticate. `token_file` is re-read on
    every list/watch (bound service-account tokens rotate); None sends no token."""

    url: str
    namespace: str
    token_file: Path | None = None
    ca_file: Path | None = None

    @classmethod
    def resolve(
        cls, config: RouterConfig, environ: Mapping[str, str],
        sa_dir: Path = SERVICE_ACCOUNT_DIR,
    ) -> ApiServer:
        """In-cluster settings (service-account token, CA and namespace) unless
        `config.k8s_api_url` is set. Raises `ConfigError` when neither is available."""
        ns_file = sa_dir / "namespace"
        namespace = config.namespace or (
            ns_file.read_text().strip() if ns_file.is_file() else "default"
        )
        token = sa_dir / "token"
        ca = sa_dir / "ca.crt"
        if config.k8s_api_url is not None:
            url = config.k8s_api_url.rstrip("/")
        elif host := environ.get("KUBERNETES_SERVICE_HOST"):
            port = environ.get("KUBERNETES_SERVICE_PORT", "443")
            url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        else:
            raise ConfigError("k8s_api_url: not running in a pod; set the API server URL")
        https = url.startswith("https://")
        return cls(url, namespace, token if https and token.is_file() else None,
                   ca if https and ca.is_file() else None)


class PodWatcher:
    """Keeps `pool`'s endpoints of `spec.role` equal to the ready pods matching
    `spec.selector`. `run()` loops until cancelled; `synced` is set after the first list.
    """

    def __init__(
        self, client: httpx.AsyncClient, api: ApiServer, spec: WatchSpec,
        pool: EndpointPool, *, watch_timeout_s: int = 300, backoff_s: float = 0.2,
    ) -> None:
        self._client = client  # its TLS settings trust the API server's CA
        self._api = api
        self._spec = spec
        self._pool = pool
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._rv: str | None = None
        self._known: dict[str, str] = {}  # pod name -> URL added to the pool
        self.synced = asyncio.Event()

    async def run(self) -> None:
        """List, then watch forever (see the module docstring for the restart rules)."""
        delay = self._backoff_s
        while True:
            try:
                if self._rv is None:
                    await self._relist()
                await self._watch()
                delay = self._backoff_s
            except _Expired:
                log.info("%s pod watch expired at resourceVersion %s; relisting",
                         self._spec.role, self._rv)
                self._rv = None
            except _TRANSIENT as exc:
                log.warning("%s pod watch failed (%s: %s); retrying in %.1fs",
                            self._spec.role, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)

    def _pods_path(self) -> str:
        return f"{self._api.url}/api/v1/namespaces/{self._api.namespace}/pods"

    async def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._api.token_file is not None:
            token = await asyncio.to_thread(self._api.token_file.read_text)
            headers["Authorization"] = f"Bearer {token.strip()}"
        return headers

    async def _relist(self) -> None:
        params = {"labelSelector": self._spec.selector}
        resp = await self._client.get(self._pods_path(), params=params,
                                      headers=await self._headers(), timeout=30)
        if resp.status_code != 200:
            raise _ApiError(f"list pods: HTTP {resp.status_code}: {resp.text[:500]}")
        pods = msgspec.json.decode(resp.content, type=_PodList)
        desired = {}
        ranks = {}
        for pod in pods.items:
            if (url := pod_url(pod, self._spec)) is not None:
                desired[pod.metadata.name] = url
                ranks[pod.metadata.name] = pod_dp_size(pod)
        for name in [n for n, url in self._known.items() if desired.get(n) != url]:
            self._forget(name)
        for name, url in desired.items():
            if name not in self._known:
                self._known[name] = url
                self._pool.add(url, self._spec.role, dp_size=ranks[name])
        self._rv = pods.metadata.resourceVersion
        self.synced.set()
        log.info("%s pods listed: %d ready (resourceVersion %s)",
                 self._spec.role, len(desired), self._rv)

    async def _watch(self) -> None:
        params = {
            "labelSelector": self._spec.selector, "watch": "true",
            "resourceVersion": self._rv or "", "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._watch_timeout_s),
        }
        # The server ends the stream after timeoutSeconds; a silent socket well past that
        # means a dead connection, so the read timeout gives it some slack.
        timeout = httpx.Timeout(10, read=self._watch_timeout_s + 30)
        async with self._client.stream("GET", self._pods_path(), params=params,
                                       headers=await self._headers(), timeout=timeout) as resp:
            if resp.status_code == 410:
                raise _Expired()
            if resp.status_code != 200:
                await resp.aread()
                raise _ApiError(f"watch pods: HTTP {resp.status_code}: {resp.text[:500]}")
            buffer = b""
            async for chunk in resp.aiter_bytes():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._on_event(msgspec.json.decode(line, type=_WatchEvent))

    def _on_event(self, event: _WatchEvent) -> None:
        if event.type == "ERROR":
            status = msgspec.json.decode(event.object, type=_Status)
            if status.code == 410:
                raise _Expired()
            raise _ApiError(f"watch error {status.code} {status.reason}: {status.message}")
        if event.type == "BOOKMARK":
            self._rv = msgspec.json.decode(event.object, type=_Pod).metadata.resourceVersion
            return
        pod = msgspec.json.decode(event.object, type=_Pod)
        name = pod.metadata.name
        url = None if event.type == "DELETED" else pod_url(pod, self._spec)
        if self._known.get(name) != url:
            if name in self._known:
                self._forget(name)
            if url is not None:
                self._known[name] = url
                self._pool.add(url, self._spec.role, dp_size=pod_dp_size(pod))
        self._rv = pod.metadata.resourceVersion

    def _forget(self, name: str) -> None:
        url = self._known.pop(name)
        # A new pod may already own this IP (events of two pods can interleave).
        if url not in self._known.values():
            self._pool.drain(url)


class KubernetesDiscovery:
    """Both roles' watchers on one httpx client. Built and run by the app's lifespan:
    `open()`, then `run()` in a task (cancel it to stop), `close()` at shutdown."""

    def __init__(self, client: httpx.AsyncClient, watchers: Sequence[PodWatcher]):
        self._client = client
        self.watchers = list(watchers)

    @classmethod
    async def open(
        cls, config: RouterConfig, pool: EndpointPool, environ: Mapping[str, str],
        *, watch_timeout_s: int = 300,
    ) -> KubernetesDiscovery:
        """Resolve the API server (raises `ConfigError`) and build the watchers."""
        api = await asyncio.to_thread(ApiServer.resolve, config, environ)
        verify: ssl.SSLContext | bool = True
        if api.ca_file is not None:
            verify = await asyncio.to_thread(ssl.create_default_context,
                                             cafile=str(api.ca_file))
        # No proxy from the environment: the API server is reached directly, as before.
        client = httpx.AsyncClient(verify=verify, trust_env=False)
        specs = [
            WatchSpec("prefill", config.prefill_selector, config.prefill_port,
                      config.engine_scheme),
            WatchSpec("decode", config.decode_selector, config.decode_port,
                      config.engine_scheme),
        ][1 if config.pd_mode == "colocated" else 0:]  # colocated: no prefill pods
        watchers = [PodWatcher(client, api, spec, pool, watch_timeout_s=watch_timeout_s)
                    for spec in specs]
        log.info("watching pods in namespace %s via %s", api.namespace, api.url)
        return cls(client, watchers)

    async def run(self) -> None:
        """Run every watcher until cancelled."""
        await asyncio.gather(*(w.run() for w in self.watchers))

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until every watcher has listed once; False if `timeout_s` passed first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                for w in self.watchers:
                    await w.synced.wait()
                return True
        return False

    async def close(self) -> None:
        """Close the HTTP client (cancel `run()` first)."""
        await self._client.aclose()
