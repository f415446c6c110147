"""The chart's engine autoscaling with several models: one KEDA ScaledObject per pool of
each P/D model, each querying the capacity signal the router exports for that model (the
series a router built from the rendered config exposes), while a colocated model keeps its
replica count (it makes no P/D decision, so it has no signal)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
from prometheus_client import CollectorRegistry, generate_latest

from pdgate.router.config import load_config
from pdgate.router.config_checks import model_configs, validate_config
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import POLICIES
from tests.deploy.conftest import write_values
from tests.deploy.helm_render import Renderer
from tests.deploy.test_helm import KUBE_VERSION, model_engines

MODELS = [
    {"name": "big", "model": "/models/big", "servedModelName": ["big-chat", "big"],
     "pdMode": "push"},
    {"name": "small", "model": "/models/small", "pdMode": "colocated",
     "decode": {"replicas": 2}},
]


def matches(query: str, series: str) -> bool:
    """Whether `max(name{l="v",...})` selects the exposition line `series`."""
    found = re.fullmatch(r"max\((\w+)\{(.*)\}\)", query)
    assert found is not None, query
    name, selectors = found.groups()
    head = series.split(" ", 1)[0]
    return head.split("{", 1)[0] == name and all(
        sel in head for sel in selectors.split(","))


def test_each_pd_models_pools_scale_on_that_models_signal(
    renderer: Renderer, tmp_path: Path
) -> None:
    r = renderer.render(write_values(tmp_path, {
        "models": MODELS, "engines": {"autoscaling": {"enabled": True}}}))
    for m in r.manifests:
        if m["kind"] != "ScaledObject":
            kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
    engines = model_engines(r)
    scaled: dict[tuple[str, str], dict[str, Any]] = {
        (s["metadata"]["labels"]["pdgate.io/model"], s["metadata"]["labels"]["pdgate.io/role"]):
        s for s in r.of("ScaledObject")}
    assert set(scaled) == {("big", "prefill"), ("big", "decode")}
    assert "replicas" not in engines["big", "prefill"]["spec"]
    assert "replicas" not in engines["big", "decode"]["spec"]
    assert engines["small", "decode"]["spec"]["replicas"] == 2  # colocated: not scaled

    # What a router built from the rendered config exports for each of its models.
    path = tmp_path / "router.yaml"
    path.write_text(r.one("ConfigMap", "-router")["data"]["router.yaml"])
    config = validate_config(load_config(path), frozenset(POLICIES))
    big, small = model_configs(config)
    assert big.decider == "measured-cost"
    registry = CollectorRegistry()
    metrics = RouterMetrics.create(registry, by_model=True)
    for one in (big, small):
        view = metrics.for_model(one.served_names[0])
        for role in ("prefill", "decode"):
            view.labels(view.pd_pressure, role).set(1.0)
    exposed = [line for line in generate_latest(registry).decode().splitlines()
               if line.startswith("pdgate_pd_pressure{")]
    for (_, role), obj in scaled.items():
        spec = obj["spec"]
        assert spec["scaleTargetRef"]["name"] == engines["big", role]["metadata"]["name"]
        query = spec["triggers"][0]["metadata"]["query"]
        # The query selects exactly big's series of its role, whatever else is exported.
        assert [s for s in exposed if matches(query, s)] == [
            f'pdgate_pd_pressure{{model="big-chat",role="{role}"}} 1.0']


def test_a_models_own_decider_must_give_the_signal(renderer: Renderer, tmp_path: Path) -> None:
    models = [{**MODELS[0], "routerConfig": {"decider": "static"}}, MODELS[1]]
    error = renderer.error(write_values(tmp_path, {
        "models": models, "engines": {"autoscaling": {"enabled": True}}}))
    assert "models[0].routerConfig.decider must be measured-cost" in error
