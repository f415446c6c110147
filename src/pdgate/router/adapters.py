"""LoRA adapters: which engine holds which, the per-request engine filter, loads on demand.

Learning: with `enable_lora` (`RouterConfig.lora_on`), every health probe that passes also
reads the engine's own `GET /v1/models` (`EngineClient.models`, decoded in
router/engines/): vLLM lists its base model and each LoRA adapter it has loaded, an adapter
with its `parent` (the base model) and its `root` (the path it was loaded from). The
engine's adapters are replaced by what it lists, so an adapter unloaded on the engine stops
being routed there at the next probe (and at once when a leg's 404 says so:
`AdapterNeed.forget`). A probe that fails keeps what the
router knew: the engine is out of routing anyway until a probe passes.

Models: the registry (`AdapterRegistry`) is one per router, keyed by engine URL; each
served model has a `ModelAdapters` view: the adapters the engines of its own pool hold, its
`lora_adapters` sources and its `load_on_demand`. A request's `model` that no model serves
by name is looked up in each model's view (router/served_models.py `ModelTable.find`).

Routing: a request whose `model` names an adapter carries an `AdapterNeed`
(router/http/api.py). The selection runner (router/policies/runner.py, every flow and the
pass-through routes go through it) keeps only the candidates that hold the adapter, so the
P and the D of a request both hold it. When no candidate of a role does:

- with `load_on_demand` and a source path (`lora_adapters`, else the `root` an engine
  holding it reports), every candidate stays and the chosen one gets the adapter loaded
  (`ensure`) before its leg is sent: `POST /v1/load_lora_adapter`, one load per engine and
  adapter however many requests wait for it (`pdgate_lora_loads_total{result}`); a failed
  load is `AdapterLoadFailed` (503 naming the adapter), never a leg on the base model;
- otherwise `AdapterUnavailable` (503 naming the adapter).

A name no engine lists and no `lora_adapters` entry names is not an adapter: the request
is a 404 `model_not_found` like any unknown model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdgate.contract.engine_replies import ModelList
from pdgate.router.engines.client import EngineClient
from pdgate.router.errors import AdapterLoadFailed, AdapterUnavailable, RouterError
from pdgate.router.metrics import RouterMetrics
from pdgate.router.pool import Endpoint, EndpointPool, Role

__all__ = ["AdapterNeed", "AdapterRegistry", "ModelAdapters", "parse_adapter_sources"]

log = logging.getLogger(__name__)


def parse_adapter_sources(entries: Sequence[str]) -> dict[str, str]:
    """`NAME=PATH` entries (validated by the config) -> {name: path}."""
    out: dict[str, str] = {}
    for entry in entries:
        name, _, path = entry.partition("=")
        out[name.strip()] = path.strip()
    return out


class AdapterRegistry:
    """Router-wide: which engine (by base URL: every DP rank of a URL, and every model
    pool listing it, share its process's adapters) holds which adapter, and the loads in
    progress. Event loop only."""

    def __init__(self, engines: EngineClient, *, load_timeout_s: float = 120.0) -> None:
        self._engines = engines
        self._timeout_s = load_timeout_s
        self._held: dict[str, dict[str, str | None]] = {}  # url -> adapter -> its root
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}

    def learn(self, url: str, models: ModelList) -> None:
        """`url` holds exactly the adapters `models` lists (entries with a `parent`)."""
        held = {card.id: card.root for card in models.data if card.parent is not None}
        before = self._held.get(url, {})
        if held.keys() != before.keys():
            log.info("engine %s holds LoRA adapters %s (was %s)", url, sorted(held) or "none",
                     sorted(before) or "none")
        self._held[url] = held

    def forget(self, url: str, name: str) -> None:
        """`url` turned out not to hold `name` (its leg was a 404): stop routing it there."""
        held = self._held.get(url)
        if held is not None and name in held:
            del held[name]
            log.info("engine %s no longer holds LoRA adapter %s", url, name)

    def holds(self, url: str, name: str) -> bool:
        return name in self._held.get(url, ())

    def held_by(self, url: str) -> Mapping[str, str | None]:
        """The adapters `url` holds, each with the root (load path) it reports."""
        return self._held.get(url, {})

    async def ensure(self, ep: Endpoint, name: str, path: str | None,
                     metrics: RouterMetrics) -> None:
        """Return once `ep`'s engine holds `name`: at once if it already does, else after
        the one load of `name` there from `path` (started by the first request that needs
        it, joined by every other; counted in `metrics`, the model's view). Raises
        `AdapterLoadFailed` / `AdapterUnavailable`."""
        if self.holds(ep.url, name):
            return
        key = (ep.url, name)
        task = self._loads.get(key)
        if task is None:
            task = asyncio.create_task(self._load(ep.url, name, path, metrics),
                                       name=f"lora-load {name}")
            self._loads[key] = task
            task.add_done_callback(lambda t: self._load_done(key, t))
        # Shielded: a waiter that leaves (its client disconnected) must not cancel the
        # load the others wait for.
        await asyncio.shield(task)

    def _load_done(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._loads.get(key) is task:
            del self._loads[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have left before it ended

    async def _load(self, url: str, name: str, path: str | None,
                    metrics: RouterMetrics) -> None:
        if path is None:
            raise AdapterUnavailable(f"LoRA adapter `{name}` has no source path to load it "
                                     f"from (lora_adapters)", param="model")
        log.info("loading LoRA adapter %s onto engine %s from %s", name, url, path)
        try:
            await self._engines.load_lora_adapter(url, name, path, self._timeout_s)
        except RouterError as exc:
            metrics.child(metrics.lora_loads, "failed").inc()
            log.warning("loading LoRA adapter %s onto engine %s failed: %s", name, url,
                        exc.message)
            raise AdapterLoadFailed(f"loading LoRA adapter `{name}` onto engine {url} "
                                    f"failed: {exc.message}", param="model") from None
        metrics.child(metrics.lora_loads, "ok").inc()
        self._held.setdefault(url, {})[name] = path


class ModelAdapters:
    """One served model's adapters: those the engines of its pool hold, plus its
    configured sources; whether it may load them (`load_on_demand`)."""

    def __init__(self, registry: AdapterRegistry, pool: EndpointPool, metrics: RouterMetrics,
                 *, load_on_demand: bool = False,
                 sources: Mapping[str, str] | None = None) -> None:
        self.registry = registry
        self.pool = pool
        self.metrics = metrics  # the model's view: its loads carry its model label
        self.load_on_demand = load_on_demand
        self._sources = dict(sources or {})

    def _urls(self) -> set[str]:
        return {ep.url for ep in self.pool.all()}

    def knows(self, name: str) -> bool:
        """Whether `name` is one of this model's adapters: an engine of its pool lists it,
        or it has a source."""
        return name in self._sources or any(
            name in self.registry.held_by(url) for url in self._urls())

    def names(self) -> list[str]:
        """Every adapter of this model (listed by its engines or configured), sorted."""
        found = set(self._sources)
        for url in self._urls():
            found.update(self.registry.held_by(url))
        return sorted(found)

    def source(self, name: str) -> str | None:
        """Where engines load `name` from: its `lora_adapters` entry, else the root an
        engine holding it reports (vLLM's `root` of an adapter is its load path)."""
        if name in self._sources:
            return self._sources[name]
        for url in sorted(self._urls()):
            if root := self.registry.held_by(url).get(name):
                return root
        return None

    def need(self, name: str) -> AdapterNeed:
        return AdapterNeed(name, self)


@dataclass(frozen=True, slots=True)
class AdapterNeed:
    """One request's LoRA adapter, as the selection runner applies it to each leg."""

    name: str
    model: ModelAdapters

    def filter(self, role: Role, candidates: list[Endpoint]) -> list[Endpoint]:
        """The candidates holding the adapter; every candidate when none does and the
        router may load it (the chosen one then gets it: `ensure`); else raises
        `AdapterUnavailable`."""
        model = self.model
        holders = [ep for ep in candidates if model.registry.holds(ep.url, self.name)]
        if holders:
            return holders
        if model.load_on_demand and model.source(self.name) is not None:
            return candidates
        why = "" if model.load_on_demand else " (load_on_demand is off)"
        raise AdapterUnavailable(f"no healthy {role} engine holds LoRA adapter "
                                 f"`{self.name}`{why}", param="model")

    def check_decode(self) -> None:
        """Before any leg: raise `AdapterUnavailable` when no healthy decode engine of the
        model holds the adapter and none may get it (every flow needs a D; without one, a
        P holding the adapter must not prefill for nothing)."""
        self.filter("decode", self.model.pool.healthy("decode"))

    async def ensure(self, ep: Endpoint) -> None:
        model = self.model
        await model.registry.ensure(ep, self.name, model.source(self.name), model.metrics)

    def forget(self, ep: Endpoint) -> None:
        self.model.registry.forget(ep.url, self.name)
