"""The /metrics of a real router and a real shim engine after real requests: promtool finds
nothing to complain about, and the series an operator builds alerts on are there."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdgate.router import __version__ as pdgate_version
from pdgate.router.health import EngineHealth, HealthSettings
from pdgate.router.metrics import RouterMetrics
from tests.e2e.cluster import Cluster, child_pids
from tests.observability.promtool import check_metrics

pytestmark = pytest.mark.slow


def scrape(url: str) -> str:
    reply = httpx.get(url + "/metrics", timeout=10)
    assert reply.status_code == 200
    return reply.text


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("who", ["router", "prefill", "decode"])
def test_promtool_finds_the_exposition_clean(cluster: Cluster, who: str) -> None:
    url = {"router": cluster.router, "prefill": cluster.prefill[0],
           "decode": cluster.decode[0]}[who]
    text = scrape(url)
    # The shim's three vLLM scheduler gauges keep vLLM's own names (with its `:`), so a
    # router reads a shim's load as it reads vLLM's; promtool's only remark is about those.
    vllm = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
            "vllm:num_requests_waiting")
    colons = [f"{name} metric names should not contain ':'" for name in vllm]
    said = re.sub(r"^exit \d+: ", "", check_metrics(text))
    remarks = [line for line in said.splitlines() if line not in colons]
    assert remarks == []
    if who != "router":
        assert all(f"\n{name}{{" in text for name in vllm)
    assert "_created" not in text  # half the series, never read by anyone


def test_router_latency_histograms_cover_long_requests_and_count_the_queue(
    cluster: Cluster,
) -> None:
    got = samples(scrape(cluster.router))
    route = ("route", "/v1/completions")
    # A generation of an hour lands in a bucket, not in +Inf.
    assert ("pdgate_request_duration_seconds_bucket",
            frozenset({route, ("le", "3600.0")})) in got
    # Every served request passed admission: two of them found a free slot at once.
    admitted = got[("pdgate_admission_wait_seconds_count",
                    frozenset({("outcome", "admitted"), ("priority_class", "normal")}))]
    assert admitted >= 2
    # The streamed request's first token (the plain one's answer came whole: no TTFT).
    assert got[("pdgate_ttft_seconds_count", frozenset({("mode", "notify")}))] >= 1


def test_shim_kv_transfer_buckets_start_at_50_microseconds(cluster: Cluster) -> None:
    # Notify mode: the prefill engine WRITEs the KV into the decode engine's blocks.
    text = scrape(cluster.prefill[0])
    les = {float(m) for m in re.findall(
        r'^pdgate_shim_kv_transfer_seconds_bucket\{[^}]*le="([^"]+)"', text, re.M)}
    assert min(les) == 0.00005
    got = samples(text)
    assert got[("pdgate_shim_kv_blocks_capacity", frozenset())] == 256
    assert not any(name.endswith("_total") and name == "pdgate_shim_kv_blocks_total"
                   for name, _ in got)


def test_router_counts_tokens_per_model(cluster: Cluster) -> None:
    got = samples(scrape(cluster.router))
    # The fixture's two requests (one plain, one streamed with its usage chunk) asked for
    # 5 tokens each.
    assert got[("pdgate_generation_tokens_total", frozenset({("model", "tiny")}))] == 10
    assert got[("pdgate_prompt_tokens_total", frozenset({("model", "tiny")}))] > 0


@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_shim_request_series_carry_the_served_model(cluster: Cluster, who: str) -> None:
    url, role = {"prefill": (cluster.prefill[0], "prefill"),
                 "decode": (cluster.decode[0], "decode")}[who]
    got = samples(scrape(url))
    model = ("model", "tiny")
    # The fixture's two P/D requests, each one leg on this engine (the 404 for model
    # "nope" never reached an engine).
    assert got[("pdgate_shim_requests_total",
                frozenset({model, ("role", role), ("status", "ok")}))] == 2
    assert got[("pdgate_shim_time_to_first_token_seconds_count",
                frozenset({model, ("role", role)}))] == 2
    assert got[("pdgate_shim_request_duration_seconds_count",
                frozenset({model, ("role", role)}))] == 2
    assert got[("pdgate_shim_prompt_tokens_total", frozenset({model}))] > 0
    assert got[("pdgate_shim_generation_tokens_total", frozenset({model}))] > 0
    # The engine's own gauges stay unlabelled.
    assert ("pdgate_shim_kv_blocks_free", frozenset()) in got


def test_router_exports_build_process_and_breaker_series(cluster: Cluster) -> None:
    got = samples(scrape(cluster.router))
    names = {name for name, _ in got}
    assert ("pdgate_build_info", frozenset({("version", pdgate_version),
                                            ("commit", "unknown")})) in got
    # The process' own series (prometheus_client's ProcessCollector).
    assert {"process_resident_memory_bytes", "process_open_fds",
            "process_cpu_seconds_total", "process_start_time_seconds"} <= names
    assert got[("process_resident_memory_bytes", frozenset())] > 10 * 2**20
    # Every engine's breaker, closed (0) while it serves.
    for role, urls in (("prefill", cluster.prefill), ("decode", cluster.decode)):
        for url in urls:
            assert got[("pdgate_engine_breaker_state",
                        frozenset({("engine", url), ("role", role)}))] == 0


def _start_time_s(pid: int) -> float:
    """A process' start time in seconds since the epoch, from /proc as Prometheus' process
    collector computes it (boot time + start ticks / clock ticks per second)."""
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_shims_export_build_info_and_their_own_process_series(
    cluster: Cluster, who: str
) -> None:
    """Each shim's scrape carries the build info and `process_*` series of that shim's
    process: its start time is the one /proc gives the process on the shim's port."""
    url = {"prefill": cluster.prefill[0], "decode": cluster.decode[0]}[who]
    got = samples(scrape(url))
    assert ("pdgate_build_info", frozenset({("version", pdgate_version),
                                            ("commit", "unknown")})) in got
    names = {name for name, _ in got}
    assert {"process_resident_memory_bytes", "process_virtual_memory_bytes",
            "process_open_fds", "process_max_fds", "process_cpu_seconds_total",
            "process_start_time_seconds"} <= names
    port = url.rsplit(":", 1)[1]
    pids = [pid for pid in child_pids(cluster.proc.pid)
            if port.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2:]
            and b"shim" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(pids) == 1, pids
    assert abs(got[("process_start_time_seconds", frozenset())] - _start_time_s(pids[0])) < 1
    assert got[("process_resident_memory_bytes", frozenset())] > 50 * 2**20  # torch + model
    assert got[("process_open_fds", frozenset())] > 0
    assert got[("process_cpu_seconds_total", frozenset())] > 0


def test_breaker_state_follows_the_breaker_at_scrape_time() -> None:
    """closed (0) -> open (1) after the failures that eject -> half-open (2) once the open
    period passed, with no event in between: the gauge is read at each scrape."""
    registry = RouterMetrics.registry()
    metrics = RouterMetrics.create(registry)
    now = [100.0]
    health = EngineHealth(HealthSettings(eject_after=2, open_s=5.0), "e",
                          clock=lambda: now[0])
    metrics.watch_breaker("http://e:1", "decode", health)
    key = ("pdgate_engine_breaker_state",
           frozenset({("engine", "http://e:1"), ("role", "decode")}))

    def state() -> float:
        return samples(generate_latest(registry).decode())[key]

    assert state() == 0
    health.record_failure()
    health.record_failure()
    assert state() == 1
    now[0] += 5.0
    assert state() == 2
    health.record_success()
    assert state() == 0
