"""The Grafana dashboard shipped with the Helm chart queries only metrics that exist: pdgate
names as a real router (notify mode: with its KV-ready proxy) and real shims expose them,
`vllm:` names as the installed vLLM defines them. Every panel has one unit, and the
namespace/release/pod variables filter every query."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import ROOT, Cluster
from tests.observability.promtool import promtool
from tests.vllm.venv import venv_dir

pytestmark = pytest.mark.slow

DASHBOARD = ROOT / "helm" / "pdgate" / "dashboards" / "pdgate.json"
# The cached vLLM venv (`make test` builds it; $PDGATE_VLLM_VENV moves it).
VLLM_SOURCES = sorted((venv_dir() / "lib").glob("python*/site-packages/vllm"))
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "summary": ("", "_sum", "_count")}
SERIES = re.compile(r"\b(?:pdgate_\w+|vllm:\w+)")


def panels(node: Any) -> Iterator[dict[str, Any]]:
    for panel in node.get("panels", []):
        if panel.get("type") == "row":
            yield from panels(panel)
        else:
            yield panel


def queries() -> list[str]:
    return [t["expr"] for p in panels(json.loads(DASHBOARD.read_text())) for t in p["targets"]]


def exposed(text: str) -> dict[str, str]:
    """Series name -> type, for every family a scrape declares (with or without samples)."""
    names: dict[str, str] = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        for suffix in SUFFIXES.get(kind, ("",)):
            names[(name.removesuffix("_total") if kind == "counter" else name) + suffix] = kind
    return names


def test_pdgate_queries_name_series_a_real_cluster_exposes(cluster: Cluster) -> None:
    known: dict[str, str] = {}
    for url in (cluster.router, cluster.prefill[0], cluster.decode[0]):
        known |= exposed(httpx.get(url + "/metrics", timeout=10).text)
    used = {s for q in queries() for s in SERIES.findall(q) if s.startswith("pdgate_")}
    assert used, "the dashboard queries no pdgate metric"
    assert sorted(used - known.keys()) == []
    assert {"pdgate_ttft_seconds_bucket", "pdgate_admission_wait_seconds_bucket",
            "pdgate_generation_tokens_total", "pdgate_proxy_wake_latency_seconds_bucket",
            "pdgate_shim_kv_transfer_seconds_bucket"} <= used


def vllm_defined() -> set[str]:
    names: set[str] = set()
    for path in VLLM_SOURCES[0].rglob("*.py"):
        names |= set(re.findall(r"name=\s*\"(vllm:\w+)\"", path.read_text(errors="replace")))
    return names


def test_vllm_queries_name_metrics_vllm_defines() -> None:
    if not VLLM_SOURCES:
        pytest.skip(f"vLLM is not installed in {venv_dir()} (`make vllm-venv` builds it)")
    defined = vllm_defined()
    used = {s for q in queries() for s in SERIES.findall(q) if s.startswith("vllm:")}
    bases = {re.sub(r"(_total|_bucket|_sum|_count)$", "", s) for s in used}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "vllm:nixl_xfer_time_seconds"} <= bases
    assert sorted(bases - defined) == []


def test_every_query_is_filtered_by_namespace_release_and_pod() -> None:
    """Each filter matches series without the label too (the variables' "All" is `.*`, and
    an absent label is the empty string): no query needs the chart's `release` relabelling,
    or namespace and pod labels at all. The variables read series that exist from the
    router's start (engine health, `up`), not counters that appear with the first request."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "release", "pod"} <= variables.keys()
    for name in ("namespace", "release", "pod"):
        v = variables[name]
        assert v["includeAll"] and v["allValue"] == ".*", name
        assert re.match(r"label_values\((pdgate_engine_healthy|up)\b", v["query"]["query"]), v
    for q in queries():
        for selector in re.findall(r"(?:pdgate_\w+|vllm:\w+)\{([^}]*)\}", q):
            assert 'namespace=~"$namespace"' in selector and 'release=~"$release"' in selector
            assert 'pod=~"$pod"' in selector
        assert len(re.findall(r"(?:pdgate_\w+|vllm:\w+)\{", q)) == len(SERIES.findall(q)), q


def test_the_variables_series_are_there_before_the_first_request(cluster: Cluster) -> None:
    """pdgate_engine_healthy has a sample per engine from the router's start (a counter
    such as pdgate_requests_total has none until a request came)."""
    text = httpx.get(cluster.router + "/metrics", timeout=10).text
    healthy = re.findall(r"^pdgate_engine_healthy\{[^}]*\} ", text, re.M)
    assert len(healthy) == len(cluster.prefill) + len(cluster.decode)


def test_each_panel_has_one_unit_and_mixes_no_seconds_with_rates() -> None:
    for panel in panels(json.loads(DASHBOARD.read_text())):
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit, f"{panel['title']}: no unit"
        assert not panel["fieldConfig"].get("overrides"), f"{panel['title']}: unit overrides"
        exprs = [t["expr"] for t in panel["targets"]]
        if unit == "s":  # latencies only: no per-second counts on a seconds axis
            assert all(e.startswith("histogram_quantile(") for e in exprs), panel["title"]


def _series_line(sample: Any, job: str) -> str:
    labels = {**sample.labels, "job": job, "instance": f"{job}:80"}
    body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{sample.name}{{{body}}}"


def test_queries_evaluate_on_a_scrape_without_any_relabelling(
    cluster: Cluster, tmp_path: Path,
) -> None:
    """Every pdgate query of the dashboard, its variables at their default (All), returns
    data from the series a real router and real shims expose, as any Prometheus scrape
    stores them (job and instance only: no namespace, pod or release label). promtool
    evaluates each one as an alert that fires when the query returns anything."""
    series: dict[str, str] = {}
    names: set[str] = set()
    for job, url in (("router", cluster.router), ("prefill", cluster.prefill[0]),
                     ("decode", cluster.decode[0])):
        text = httpx.get(url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created") or s.value != s.value:  # NaN
                    continue
                names.add(s.name)
                grows = family.type in ("counter", "histogram", "summary")
                # Counters grow over the test window, so every rate() has something to show.
                series[_series_line(s, job)] = (f"0+{max(s.value, 1.0)}x10" if grows
                                                else f"{s.value}x10")
    rules: list[dict[str, Any]] = []
    tests: list[dict[str, Any]] = []
    for i, query in enumerate(queries()):
        used = set(SERIES.findall(query))
        if not used or any(not s.startswith("pdgate_") for s in used):
            continue  # vLLM's series: not in this cluster
        if not used <= names:
            continue  # a series with no sample yet (nothing happened that it counts)
        expr = (query.replace("$namespace", ".*").replace("$release", ".*")
                .replace("$pod", ".*").replace("$__rate_interval", "2m"))
        rules.append({"alert": f"q{i}", "expr": f"count({expr}) > 0",
                      "labels": {"severity": "none"}})
        tests.append({"eval_time": "10m", "alertname": f"q{i}",
                      "exp_alerts": [{"exp_labels": {"severity": "none"}}]})
    assert len(rules) >= 15, f"only {len(rules)} queries evaluated"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "dashboard", "rules": rules}]}))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "alert_rule_test": tests, "input_series": [
            {"series": k, "values": v} for k, v in series.items()]}]}))
    out = subprocess.run([promtool(), "test", "rules", "test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
