"""The models one router serves, each with its own engine pool, flows and orchestrator.

A request names its model; `ModelTable.resolve` finds the model serving that name with one
dict lookup (every served name and alias is a key), so routing by model costs the same for
one model as for many; `ModelTable.find` also finds the model of a LoRA adapter's name. A
router configured with today's one-model flags has one entry.

An engine URL may serve several models: each model's pool then holds its own endpoint for
it, with that model's in-flight count, health verdicts and breaker (an engine that fails one
model's requests keeps serving the others until its own probes fail).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdgate.router.adapters import AdapterNeed, ModelAdapters
from pdgate.router.config import RouterConfig
from pdgate.router.engine_cards import EngineCards
from pdgate.router.errors import ModelNotFound
from pdgate.router.metrics import RouterMetrics
from pdgate.router.orchestrator import Orchestrator
from pdgate.router.pool import EndpointPool

__all__ = ["ModelTable", "ServedModel"]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model: its one-model config (router/config.py `model_configs`), its engines and
    the orchestrator that runs its requests."""

    config: RouterConfig
    pool: EndpointPool
    orchestrator: Orchestrator
    adapters: ModelAdapters | None = None  # its LoRA adapters (None: enable_lora is off)
    cards: EngineCards | None = None  # what its engines' /v1/models say (None: not read)
    # The first served name (how logs, metrics and `/ready` name the model) and the name the
    # engines know it by; worked out once here, not per request.
    name: str = field(init=False)
    engine_model: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.config.served_names[0])
        object.__setattr__(self, "engine_model", self.config.engine_model)

    @property
    def max_model_len(self) -> int | None:
        """The context length: configured, else what its engines report, else the
        tokenizer's (None: unknown)."""
        if self.config.max_model_len:
            return self.config.max_model_len
        learned = None if self.cards is None else self.cards.max_model_len(
            self._urls(), self.engine_model)
        tokenizer = self.orchestrator.tokenizer
        return learned or (tokenizer.max_model_len if tokenizer is not None else None)

    @property
    def root(self) -> str:
        """Where the engines loaded the model from, as they report it (else the
        configured model)."""
        found = None if self.cards is None else self.cards.root(self._urls(), self.engine_model)
        return found or self.config.model

    def _urls(self) -> list[str]:
        return list(dict.fromkeys(ep.url for ep in self.pool.all()))

    @property
    def metrics(self) -> RouterMetrics:
        """This model's view of the router metrics (`RouterMetrics.for_model`)."""
        return self.orchestrator.metrics

    def ready_body(self) -> dict[str, object]:
        """This model's part of `/ready`: whether it has a ready pair, and its counts."""
        return {"ready": self.pool.ready(),
                "prefill_healthy": len(self.pool.healthy("prefill")),
                "decode_healthy": len(self.pool.healthy("decode")),
                "pd_mode": self.config.pd_mode}


class ModelTable:
    """Every served model, found by any of its served names. The first is the default: it
    serves requests that name no model."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("a router serves at least one model")
        self.models = tuple(models)
        self.default = self.models[0]
        self._by_name = {name: m for m in self.models for name in m.config.served_names}

    def resolve(self, name: str | None) -> ServedModel:
        """The model serving `name` (None: the default). Raises `ModelNotFound` (404)."""
        if name is None:
            return self.default
        found = self._by_name.get(name)
        if found is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return found

    def find(self, name: str | None) -> tuple[ServedModel, AdapterNeed | None]:
        """`resolve`, or, for a name no model serves, the model one of whose LoRA adapters
        it names (router/adapters.py) and the request's need for that adapter."""
        found = self._by_name.get(name) if name is not None else self.default
        if found is not None:
            return found, None
        for m in self.models:
            if m.adapters is not None and name is not None and m.adapters.knows(name):
                return m, m.adapters.need(name)
        raise ModelNotFound(f"The model `{name}` does not exist.", param="model")

    def ready(self) -> bool:
        """True when every model has a ready pair (a decode engine for a colocated one)."""
        return all(m.pool.ready() for m in self.models)

    def pools(self) -> list[EndpointPool]:
        """Each model's engine pool, in configuration order."""
        return [m.pool for m in self.models]
