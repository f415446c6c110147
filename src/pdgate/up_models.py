"""`pdgate up --models N`: several tiny models behind one router.

Model 0 is the `--model` of the cluster; model i > 0 is the built-in tiny model with seed
`TINY_SEED + i` (same shape and tokenizer, other weights, so each model answers
differently), served as `<name>-<i+1>`. Each model gets `--prefill` prefill and `--decode`
decode engines of its own; the last `--colocated-models` of them get decode engines only
and run colocated. The router then reads a `models:` config written to the log directory
(docs/configuration.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelPlan", "plan_models", "write_router_config"]


@dataclass(frozen=True)
class ModelPlan:
    """One model of the cluster: its served name, directory and engine counts (no
    prefill engines: colocated)."""

    name: str
    model_dir: str
    prefill: int
    decode: int

    @property
    def colocated(self) -> bool:
        return self.prefill == 0


def plan_models(models: int, colocated: int, model_dir: str, served: str, prefill: int,
                decode: int) -> list[ModelPlan]:
    """The models of a cluster, model 0 first (see the module docstring)."""
    plans = []
    for i in range(models):
        path = model_dir if i == 0 else str(_seeded_tiny(Path(model_dir), i))
        on_p = 0 if i >= models - colocated else prefill
        plans.append(ModelPlan(served if i == 0 else f"{served}-{i + 1}", path, on_p, decode))
    return plans


def _seeded_tiny(model_dir: Path, i: int) -> Path:
    from pdgate.engine_shim.tiny import TINY_SEED, ensure_tiny_model

    seed = TINY_SEED + i
    return ensure_tiny_model(model_dir.parent / f"{model_dir.name}-seed{seed}", seed=seed)


def write_router_config(path: Path, plans: list[ModelPlan],
                        engines: list[tuple[list[str], list[str]]]) -> Path:
    """Write the router's `models:` config (JSON, which YAML reads) for `plans`, whose
    (prefill URLs, decode URLs) are `engines`; returns `path`."""
    models = []
    for plan, (prefill, decode) in zip(plans, engines, strict=True):
        entry: dict[str, object] = {"model": plan.model_dir, "served_model_name": [plan.name],
                                    "prefill": prefill, "decode": decode}
        if plan.colocated:
            entry["pd_mode"] = "colocated"
        models.append(entry)
    path.write_text(json.dumps({"models": models}, indent=2) + "\n")
    return path
