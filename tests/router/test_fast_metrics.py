"""router/fast_metrics.py exposes exactly what prometheus_client's metrics do after the
same updates (the router's scrape must not change when its metrics lost their locks)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdgate.router.fast_metrics import FastCounter, FastGauge, FastHistogram
from pdgate.router.metrics import NoCreatedRegistry, RouterMetrics

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def _updates(counter: Any, labelled: Any, gauge: Any, hist: Any, plain_hist: Any) -> None:
    counter.inc()
    counter.inc(2.5)
    labelled.labels("/v1/completions", "200").inc()
    labelled.labels("/v1/chat/completions", 404).inc(3)  # label values become strings
    labelled.labels("/v1/completions", "200").inc()
    labelled.labels("/gone", "500").inc()
    labelled.remove("/gone", "500")
    gauge.labels("http://e:1", "prefill").inc()
    gauge.labels("http://e:1", "prefill").inc()
    gauge.labels("http://e:1", "prefill").dec()
    gauge.labels("http://e:2", "decode").set(7)
    gauge.labels("fn", "decode").set_function(lambda: 42)
    for v in (0.0005, 0.001, 0.0011, 0.5, 3.0, 99.0, 1e9):
        hist.labels("pull").observe(v)
    hist.labels("direct").observe(0.02)
    plain_hist.observe(0.3)


def _build(kinds: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]],
           registry: CollectorRegistry) -> None:
    counter, gauge, hist = kinds
    _updates(
        counter("t_plain", "A counter without labels", registry=registry),
        counter("t_requests_total", "HTTP requests", ["route", "status"], registry=registry),
        gauge("t_in_flight", "In flight", ["engine", "role"], registry=registry),
        hist("t_ttft_seconds", "TTFT", ["mode"], buckets=BUCKETS, registry=registry),
        hist("t_leg_seconds", "Leg", buckets=BUCKETS, registry=registry),
    )
    gauge("t_idle", "A gauge never set", registry=registry)
    counter("t_unused", "A labelled counter never used", ["reason"], registry=registry)


def _without_created(text: str) -> str:
    return re.sub(r"^\S*_created(\{[^}]*\})? \S+\n", "", text, flags=re.M)


def test_the_exposition_is_prometheus_clients() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    _build((FastCounter, FastGauge, FastHistogram), ours)
    _build((Counter, Gauge, Histogram), theirs)
    got, want = generate_latest(ours).decode(), generate_latest(theirs).decode()
    assert _without_created(got) == _without_created(want)
    # The same `_created` series, with creation times.
    created = re.compile(r"^(\S*_created(?:\{[^}]*\})?) ", re.M)
    assert created.findall(got) == created.findall(want) != []


def test_the_routers_registry_drops_created_series() -> None:
    ours, theirs = NoCreatedRegistry(), NoCreatedRegistry()
    _build((FastCounter, FastGauge, FastHistogram), ours)
    _build((Counter, Gauge, Histogram), theirs)
    assert generate_latest(ours) == generate_latest(theirs)
    assert b"_created" not in generate_latest(ours)


def test_router_metrics_scrape_as_before() -> None:
    """Every router family's HELP/TYPE lines and unlabelled series, as the prometheus_client
    metrics of the same names printed them."""
    text = generate_latest(_router_registry()).decode()
    assert "# TYPE pdgate_requests_total counter" in text
    assert "# HELP pdgate_requests_total HTTP requests by route and status" in text
    assert "# TYPE pdgate_prefill_duration_seconds histogram" in text
    assert 'pdgate_prefill_duration_seconds_bucket{le="+Inf"} 0.0' in text
    assert "pdgate_admission_active 0.0" in text


def _router_registry() -> CollectorRegistry:
    registry = RouterMetrics.registry()
    RouterMetrics.create(registry)
    return registry


def test_misuse_raises_as_prometheus_client_does() -> None:
    registry = CollectorRegistry()
    counter = FastCounter("c", "c", ["a"], registry=registry)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("x").inc(-1)
    with pytest.raises(ValueError, match="label count"):
        counter.labels("x", "y")
    with pytest.raises(ValueError, match="has labels"):
        counter.inc()
    with pytest.raises(KeyError):
        counter.remove("never")
    with pytest.raises(ValueError, match="sorted"):
        FastHistogram("h", "h", buckets=(1.0, 0.5), registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        FastCounter("c_total", "again", ["a"], registry=registry)


def test_clear_forgets_every_series() -> None:
    registry = CollectorRegistry()
    gauge = FastGauge("g", "g", ["engine"], registry=registry)
    gauge.labels("a").set(1)
    gauge.clear()
    assert registry.get_sample_value("g", {"engine": "a"}) is None
    gauge.labels("a").inc()
    assert registry.get_sample_value("g", {"engine": "a"}) == 1.0
