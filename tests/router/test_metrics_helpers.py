"""RouterMetrics' whole-fact helpers: TTFT from arrival, tokens per model from a usage
object, admission waits; and the scrape leaves `*_created` series out."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdgate.router import request_context
from pdgate.router.admission import Admission
from pdgate.router.errors import Overloaded
from pdgate.router.metrics import RouterMetrics

REGISTRIES: dict[int, CollectorRegistry] = {}


@pytest.fixture
def metrics() -> RouterMetrics:
    registry = RouterMetrics.registry()
    m = RouterMetrics.create(registry)
    REGISTRIES[id(m)] = registry
    return m


def value(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return REGISTRIES[id(metrics)].get_sample_value(name, labels)


def test_usage_counts_tokens_per_model_and_notes_them_on_the_request(
    metrics: RouterMetrics,
) -> None:
    record = request_context.RequestRecord("POST", "/v1/completions")
    token = request_context.open_record(record)
    try:
        metrics.observe_usage("tiny", {"prompt_tokens": 7, "completion_tokens": 3,
                                       "total_tokens": 10})
    finally:
        request_context.close_record(token)
    metrics.observe_usage("other", {"prompt_tokens": 2, "completion_tokens": True})
    metrics.observe_usage("other", None)  # an engine that sent no usage: nothing counted
    assert value(metrics, "pdgate_prompt_tokens_total", model="tiny") == 7
    assert value(metrics, "pdgate_generation_tokens_total", model="tiny") == 3
    assert value(metrics, "pdgate_prompt_tokens_total", model="other") == 2
    assert value(metrics, "pdgate_generation_tokens_total", model="other") is None
    assert (record.model, record.prompt_tokens, record.completion_tokens) == ("tiny", 7, 3)


def test_ttft_runs_from_arrival(metrics: RouterMetrics) -> None:
    record = request_context.RequestRecord("POST", "/v1/completions", arrival=100.0)
    token = request_context.open_record(record)
    try:
        metrics.observe_ttft("pull", arrival=100.0, now=100.75)
    finally:
        request_context.close_record(token)
    assert value(metrics, "pdgate_ttft_seconds_sum", mode="pull") == pytest.approx(0.75)
    assert value(metrics, "pdgate_ttft_seconds_bucket", mode="pull", le="0.5") == 0
    assert (record.mode, record.ttft_s) == ("pull", pytest.approx(0.75))


async def test_admission_reports_queue_waits_by_outcome(metrics: RouterMetrics) -> None:
    admission = Admission(1, 1, 0.05, on_wait=metrics.observe_admission_wait)
    first = await admission.acquire()  # a free slot: waited 0
    with pytest.raises(Overloaded):
        await admission.acquire()  # queued, nobody released: timed out
    queued = asyncio.ensure_future(admission.acquire(priority=-3))
    await asyncio.sleep(0)
    first.release()
    (await queued).release()
    count = "pdgate_admission_wait_seconds_count"
    normal, high = {"priority_class": "normal"}, {"priority_class": "high"}
    assert value(metrics, count, outcome="admitted", **normal) == 1
    assert value(metrics, count, outcome="admitted", **high) == 1  # by priority class
    assert value(metrics, count, outcome="timeout", **normal) == 1
    assert (value(metrics, "pdgate_admission_wait_seconds_sum", outcome="timeout",
                  **normal) or 0) >= 0.05


def test_scrape_has_no_created_series(metrics: RouterMetrics) -> None:
    metrics.child(metrics.requests, "/v1/completions", "200").inc()
    metrics.child(metrics.ttft, "pull").observe(0.1)
    text = generate_latest(REGISTRIES[id(metrics)]).decode()
    assert 'pdgate_requests_total{route="/v1/completions",status="200"} 1.0' in text
    assert "_created" not in text
