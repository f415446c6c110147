"""The router's Prometheus metrics (`pdgate_` prefix) on a registry owned by one app.

`RouterMetrics.create(registry)` registers everything; nothing is module-global, so two apps
in one process (tests) never collide. Callers record at the boundary: the API layer counts
requests, the flows time legs and count decisions, the pool keeps the gauges, admission
times the queue. Helpers take whole facts so callers need no label bookkeeping:
`observe_ttft(mode, arrival)` (streams; `served_whole(mode)` for a whole answer) and
`observe_usage(model, usage)`; `observe_answer(raw)` and
`StreamUsage` find the usage in what the client got (a JSON answer, SSE lines).

Also on every app's registry: `pdgate_build_info{version,commit}` (always 1; the commit is
the image's PDGATE_COMMIT build argument, `unknown` from a source checkout), the process'
own `process_*` series (RSS, CPU seconds, open fds: prometheus_client's ProcessCollector)
and `pdgate_engine_breaker_state{engine,role}` (0 closed, 1 open, 2 half-open), read from
each engine's breaker at scrape time (`watch_breaker`), so an open breaker that turned
half-open with time shows as such without an event.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import msgspec
from prometheus_client import CollectorRegistry

from pdgate.common.metrics_registry import NoCreatedRegistry, register_process_series
from pdgate.router import __version__, request_context
from pdgate.router.admission import priority_label
from pdgate.router.fast_metrics import (
    CounterChild,
    FastCounter,
    FastGauge,
    FastHistogram,
    GaugeChild,
    HistogramChild,
    MetricFamily,
)

C = TypeVar("C", CounterChild, GaugeChild, HistogramChild)

__all__ = ["NoCreatedRegistry", "RouterMetrics", "StreamUsage"]

# Seconds. TTFT/prefill span sub-millisecond fakes to multi-second real prompts.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
# A whole request: a long generation streams for many minutes, and one that lands in +Inf
# makes every quantile above it unreadable. Up to four hours.
_DURATION_BUCKETS = _LATENCY_BUCKETS + (120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
                                        14400.0)
# Waiting for an admission slot: zero when there is capacity, up to the queue timeout.
_QUEUE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_DATA = b"data: "
# pdgate_engine_breaker_state's values (health.BreakerState.value -> number).
BREAKER_STATE_VALUES = {"closed": 0, "open": 1, "half-open": 2}
# The families that carry a leading `model` label when the router serves several models.
_BY_MODEL = ("requests", "request_duration", "ttft", "inter_token_latency", "prefill_duration",
             "fallbacks", "retries", "disagg_decisions", "engine_healthy", "engine_in_flight",
             "policy_duration", "prefix_lookup_blocks", "prefix_hit_blocks",
             "prefix_index_entries", "kv_event_batches", "kv_event_gaps", "breaker_opened",
             "engine_breaker_state", "lora_loads", "decider_switches",
             "decider_overrides", "decider_prediction_ratio", "engine_requests_waiting",
             "engine_requests_running", "engine_kv_usage", "pd_pressure", "pd_recommended_ratio")


class _Breaker(Protocol):
    """What `watch_breaker` reads: router.health.EngineHealth."""

    @property
    def state(self) -> Any: ...


class _Answer(msgspec.Struct):
    """The two fields of an OpenAI answer or stream chunk the token counters read: msgspec
    skips the rest (choices, text) without building it."""

    model: Any = None
    usage: Any = None


_decode_answer = msgspec.json.Decoder(_Answer).decode
# What `_decode_answer` raises on bytes that are not a JSON object (ValidationError is a
# DecodeError); RecursionError for nesting deeper than the interpreter allows.
_NOT_AN_ANSWER = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def _read_answer(raw: bytes) -> _Answer | None:
    try:
        answer = _decode_answer(raw)
    except _NOT_AN_ANSWER:
        return None
    return answer if isinstance(answer.usage, dict) else None


def _model_label(model: object) -> str:
    return model if isinstance(model, str) and model else "unknown"


@dataclass(frozen=True)
class RouterMetrics:
    """Handles to every router metric. Label names are documented on each field."""

    requests: FastCounter  # route, status
    request_duration: FastHistogram  # route: arrival -> last byte sent
    ttft: FastHistogram  # mode: arrival at the router -> first decode byte (see observe_ttft)
    # outcome (admitted | timeout | cancelled), priority_class (high | normal | low): time
    # in the queue
    admission_wait: FastHistogram
    prompt_tokens: FastCounter  # model: prompt tokens of served requests (from usage)
    generation_tokens: FastCounter  # model: completion tokens of served requests (from usage)
    inter_token_latency: FastHistogram  # gap between streamed chunks from decode
    prefill_duration: FastHistogram  # prefill leg round trip
    fallbacks: FastCounter  # reason
    retries: FastCounter  # role
    disagg_decisions: FastCounter  # reason
    decider_switches: FastCounter  # to (disagg | direct): a bucket's mode changed
    decider_overrides: FastCounter  # to: a request took the mode its bucket does not hold
    decider_prediction_ratio: FastHistogram  # choice: measured / predicted TTFT
    pd_pressure: FastGauge  # role: capacity signal (measured-cost decider)
    pd_recommended_ratio: FastGauge  # P engines per D engine the pressures call for
    engine_healthy: FastGauge  # engine, role (1 healthy, 0 not)
    engine_in_flight: FastGauge  # engine, role
    # engine, role: the engine's own scheduler state from its /metrics (engine_load.py)
    engine_requests_waiting: FastGauge
    engine_requests_running: FastGauge
    engine_kv_usage: FastGauge  # 0..1
    policy_duration: FastHistogram  # role: one endpoint selection (all policy stages)
    prefix_lookup_blocks: FastCounter  # role: full prompt blocks routed
    prefix_hit_blocks: FastCounter  # role: of those, blocks the chosen engine was known to hold
    prefix_index_entries: FastGauge  # index (approx | kv_events): (engine, block) entries
    kv_event_batches: FastCounter  # engine: KV-event batches received
    kv_event_gaps: FastCounter  # engine: sequence gaps (lost KV-event messages)
    admission_active: FastGauge  # requests holding an admission slot
    admission_queued: FastGauge  # requests waiting for a slot
    admission_rejected: FastCounter  # reason (queue_full | queue_timeout | quota)
    client_tokens: FastCounter  # key (a client key's name): prompt + completion tokens
    kv_aborts: FastCounter  # result (ok | unsupported | failed): P asked to free a request's KV
    lora_loads: FastCounter  # result (ok | failed): LoRA adapter loads the router asked for
    breaker_opened: FastCounter  # role: circuit breakers opened (engines ejected)
    engine_breaker_state: FastGauge  # engine, role: BREAKER_STATE_VALUES, read at scrape
    # reason (engines/http11.py DISCARD_REASONS): engine connections closed for their bytes
    engine_connections_discarded: FastCounter
    # reason (request_id | kv_params: the answer named another request; prompt_ids |
    # first_token: P's early first token failed its check, the plain flow ran)
    engine_answers_refused: FastCounter
    # The model this view counts for (`for_model`); None: the router's own view (requests
    # refused before their model is known count under model "").
    model: str | None = None
    # Families with a leading `model` label: every per-request and per-engine family of a
    # router serving several models; none for one model (its series stay as they were).
    _model_families: frozenset[int] = field(default=frozenset(), repr=False)
    _children: dict[tuple[int, tuple[str, ...]], Any] = field(default_factory=dict, repr=False)

    def child(self, metric: MetricFamily[C], *labels: str) -> C:
        """`metric.labels(*labels)`, cached: label values on the hot path come from small
        fixed sets (routes, statuses, reasons); one dict lookup, no label conversion. The
        view's model goes first where the family has a model label; an unlabelled family
        is its own child."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = self.labels(metric, *labels)
        return found  # type: ignore[no-any-return]

    def labels(self, metric: MetricFamily[C], *labels: str) -> C:
        """`child` uncached: for series made once per engine (gauges, breakers)."""
        if id(metric) in self._model_families:
            labels = (self.model or "", *labels)
        if not labels:
            return metric  # type: ignore[return-value]  # observe()/inc() on the family
        return metric.labels(*labels)

    def remove(self, metric: MetricFamily[C], *labels: str) -> None:
        """Forget one series of `metric` (KeyError when absent), this view's model first
        where the family has a model label."""
        if id(metric) in self._model_families:
            labels = (self.model or "", *labels)
        metric.remove(*labels)

    def for_model(self, name: str) -> RouterMetrics:
        """The view one model's pool, routing and flows record through: the same families,
        with `name` as their model label (a router serving several models)."""
        return replace(self, model=name, _children={})

    def observe_ttft(self, mode: str, arrival: float, now: float | None = None) -> None:
        """Record one stream's time to first token: from `arrival` (`time.perf_counter()`
        when the request reached the router, before its body was read and before any
        admission queue) to `now` (default: the current time), when the first decode byte
        arrived. `mode` is the flow that served it (label). Also noted on the request's
        access-log line."""
        ttft = (time.perf_counter() if now is None else now) - arrival
        self.child(self.ttft, mode).observe(ttft)
        record = request_context.current()
        if record is not None:
            record.mode = mode
            record.ttft_s = ttft
            if record.watcher is not None:
                record.watcher.first_token(ttft)

    def served_whole(self, mode: str) -> None:
        """A non-streaming answer came back whole from the flow `mode`: noted on the
        request's access-log line. No time to first token: the router never saw that
        token. Taken for one, the time to the whole answer (every token generated) counted
        against the chart's TTFT SLO alert and taught the measured-cost decider a D whose
        prefill took as long as its generation."""
        record = request_context.current()
        if record is not None:
            record.mode = mode

    def observe_prefill(self, seconds: float) -> None:
        """Record one request's prefill leg round trip (`seconds`), for the metric and
        for whoever watches the request (router/request_context.py)."""
        self.child(self.prefill_duration).observe(seconds)
        record = request_context.current()
        if record is None:
            return
        if record.prefill_s is None:  # a migration's later P leg is not the request's TTFT
            record.prefill_s = seconds
        if record.watcher is not None:
            record.watcher.prefill_done(seconds)

    def observe_usage(self, model: str, usage: object) -> None:
        """Count one finished request's tokens from its final OpenAI `usage` object
        (`prompt_tokens`, `completion_tokens`; missing or non-integer fields count 0) under
        the served `model` name. Call once per request, with the usage the client got."""
        if not isinstance(usage, dict):
            return
        prompt, completion = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
        if prompt:
            self.child(self.prompt_tokens, model).inc(prompt)
        if completion:
            self.child(self.generation_tokens, model).inc(completion)
        record = request_context.current()
        if record is not None:
            record.model = model
            record.prompt_tokens, record.completion_tokens = prompt, completion

    def observe_answer(self, raw: bytes) -> None:
        """Count a non-streaming answer's tokens from the body sent to the client (its
        `model` and `usage`; nothing is counted without a usage object)."""
        answer = _read_answer(raw)
        if answer is not None:
            self.observe_usage(_model_label(answer.model), answer.usage)

    def count_fallback(self, reason: str) -> None:
        """Count one decode leg run without KV from prefill (`reason`: label) and note it
        on the request's access-log line."""
        self.child(self.fallbacks, reason).inc()
        record = request_context.current()
        if record is not None:
            record.fallback = reason

    def observe_admission_wait(self, outcome: str, seconds: float, priority: int = 0) -> None:
        """Record how long one request of `priority` waited for an admission slot (0 when
        one was free); also noted on the request's access line and span."""
        self.child(self.admission_wait, outcome, priority_label(priority)).observe(seconds)
        record = request_context.current()
        if record is not None:
            record.admission_wait_s = seconds

    def watch_breaker(self, engine: str, role: str, breaker: _Breaker) -> None:
        """Export `breaker`'s state as `pdgate_engine_breaker_state{engine,role}`, read at
        each scrape (the pool calls this when it gives an engine its breaker; remove the
        series with the engine's other gauges)."""
        self.labels(self.engine_breaker_state, engine, role).set_function(
            lambda: BREAKER_STATE_VALUES[breaker.state.value])

    @staticmethod
    def registry() -> CollectorRegistry:
        """A fresh registry for one app's metrics (no `*_created` series in its scrape)."""
        return NoCreatedRegistry()

    @classmethod
    def create(cls, registry: CollectorRegistry, *, by_model: bool = False) -> RouterMetrics:
        """Register all metrics on `registry` (one registry per app), with the build info
        and this process' `process_*` series. `by_model` (a router serving several
        models): every per-request and per-engine family gets a leading `model` label."""
        r = registry
        m = ["model"] if by_model else []
        register_process_series(r, __version__, os.environ)
        families = cls(
            requests=FastCounter(
                "pdgate_requests", "HTTP requests by route and status", [*m, "route", "status"],
                registry=r,
            ),
            request_duration=FastHistogram(
                "pdgate_request_duration_seconds", "End-to-end request time", [*m, "route"],
                buckets=_DURATION_BUCKETS, registry=r,
            ),
            ttft=FastHistogram(
                "pdgate_ttft_seconds",
                "Request arrival at the router to the first byte from the decode engine",
                [*m, "mode"], buckets=_LATENCY_BUCKETS, registry=r,
            ),
            admission_wait=FastHistogram(
                "pdgate_admission_wait_seconds",
                "Time a request waited for an admission slot, by outcome and priority class",
                ["outcome", "priority_class"],
                buckets=_QUEUE_BUCKETS, registry=r,
            ),
            prompt_tokens=FastCounter(
                "pdgate_prompt_tokens", "Prompt tokens of served requests", ["model"],
                registry=r,
            ),
            generation_tokens=FastCounter(
                "pdgate_generation_tokens", "Completion tokens of served requests", ["model"],
                registry=r,
            ),
            inter_token_latency=FastHistogram(
                "pdgate_inter_token_latency_seconds", "Gap between streamed decode chunks",
                m, buckets=_ITL_BUCKETS, registry=r,
            ),
            prefill_duration=FastHistogram(
                "pdgate_prefill_duration_seconds", "Prefill leg round trip",
                m, buckets=_LATENCY_BUCKETS, registry=r,
            ),
            fallbacks=FastCounter(
                "pdgate_fallbacks", "Decode legs run without KV from prefill", [*m, "reason"],
                registry=r,
            ),
            lora_loads=FastCounter(
                "pdgate_lora_loads", "LoRA adapter loads the router sent to engines "
                "(one per engine and adapter, however many requests waited)", [*m, "result"],
                registry=r,
            ),
            retries=FastCounter(
                "pdgate_retries", "Engine legs retried on another engine", [*m, "role"],
                registry=r,
            ),
            disagg_decisions=FastCounter(
                "pdgate_disagg_decisions", "Disaggregate-or-not decisions", [*m, "reason"],
                registry=r,
            ),
            decider_switches=FastCounter(
                "pdgate_decider_switches", "Measured-cost decider: a prompt-length bucket "
                "changed its mode", [*m, "to"], registry=r,
            ),
            decider_overrides=FastCounter(
                "pdgate_decider_overrides", "Measured-cost decider: a request took the mode "
                "its bucket does not hold (predicted cheaper by more than the margin)",
                [*m, "to"], registry=r,
            ),
            decider_prediction_ratio=FastHistogram(
                "pdgate_decider_prediction_ratio", "Measured-cost decider: measured / "
                "predicted time to first token", [*m, "choice"],
                buckets=(0.25, 0.5, 0.67, 0.75, 0.8, 0.9, 1.0, 1.11, 1.25, 1.33, 1.5, 2.0, 4.0),
                registry=r,
            ),
            pd_pressure=FastGauge(
                "pdgate_pd_pressure", "Capacity signal (measured-cost decider): prefill, "
                "seconds of prompt work queued per unit of the P pool's measured "
                "throughput; decode, the D pool's mean KV usage", [*m, "role"], registry=r,
            ),
            pd_recommended_ratio=FastGauge(
                "pdgate_pd_recommended_ratio", "P engines per D engine that would bring both "
                "pools' pressure to their targets (0: no pressure to compare)", m,
                registry=r,
            ),
            engine_healthy=FastGauge(
                "pdgate_engine_healthy", "1 if the engine's last health check passed",
                [*m, "engine", "role"], registry=r,
            ),
            engine_in_flight=FastGauge(
                "pdgate_engine_in_flight", "Requests in flight per engine", [*m, "engine", "role"],
                registry=r,
            ),
            engine_requests_waiting=FastGauge(
                "pdgate_engine_requests_waiting", "Requests queued in the engine, as its "
                "/metrics said (vllm:num_requests_waiting)", [*m, "engine", "role"], registry=r,
            ),
            engine_requests_running=FastGauge(
                "pdgate_engine_requests_running", "Requests running in the engine, as its "
                "/metrics said (vllm:num_requests_running)", [*m, "engine", "role"], registry=r,
            ),
            engine_kv_usage=FastGauge(
                "pdgate_engine_kv_usage", "Fraction of the engine's KV cache in use, as its "
                "/metrics said (vllm:kv_cache_usage_perc)", [*m, "engine", "role"], registry=r,
            ),
            policy_duration=FastHistogram(
                "pdgate_policy_duration_seconds", "Time to select one engine", [*m, "role"],
                buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
                registry=r,
            ),
            prefix_lookup_blocks=FastCounter(
                "pdgate_prefix_lookup_blocks", "Full prompt blocks routed", [*m, "role"],
                registry=r,
            ),
            prefix_hit_blocks=FastCounter(
                "pdgate_prefix_hit_blocks",
                "Routed prompt blocks the chosen engine was known to hold", [*m, "role"],
                registry=r,
            ),
            prefix_index_entries=FastGauge(
                "pdgate_prefix_index_entries", "(engine, block) entries in a prefix index",
                [*m, "index"], registry=r,
            ),
            kv_event_batches=FastCounter(
                "pdgate_kv_event_batches", "KV-event batches received", [*m, "engine"],
                registry=r,
            ),
            kv_event_gaps=FastCounter(
                "pdgate_kv_event_gaps", "Gaps in KV-event sequence numbers", [*m, "engine"],
                registry=r,
            ),
            admission_active=FastGauge(
                "pdgate_admission_active", "Requests holding an admission slot", registry=r,
            ),
            admission_queued=FastGauge(
                "pdgate_admission_queued", "Requests waiting for an admission slot", registry=r,
            ),
            admission_rejected=FastCounter(
                "pdgate_admission_rejected", "Requests refused with 429", ["reason"],
                registry=r,
            ),
            client_tokens=FastCounter(
                "pdgate_client_tokens", "Prompt plus completion tokens relayed to the "
                "requests of each client key (its name), what token quotas count", ["key"],
                registry=r,
            ),
            kv_aborts=FastCounter(
                "pdgate_kv_aborts", "Requests to a prefill engine to free a request's KV",
                ["result"], registry=r,
            ),
            breaker_opened=FastCounter(
                "pdgate_breaker_opened", "Engine circuit breakers opened (engine ejected)",
                [*m, "role"], registry=r,
            ),
            engine_breaker_state=FastGauge(
                "pdgate_engine_breaker_state",
                "Engine circuit breaker state: 0 closed, 1 open (ejected), 2 half-open",
                [*m, "engine", "role"], registry=r,
            ),
            engine_connections_discarded=FastCounter(
                "pdgate_engine_connections_discarded",
                "Engine connections closed for bytes past a response's framing", ["reason"],
                registry=r,
            ),
            engine_answers_refused=FastCounter(
                "pdgate_engine_answers_refused",
                "Engine answers refused: they answered another request, or P's early first "
                "token failed its check",
                ["reason"], registry=r,
            ),
        )
        if not by_model:
            return families
        labelled = frozenset(id(getattr(families, name)) for name in _BY_MODEL)
        return replace(families, _model_families=labelled)


class StreamUsage:
    """The last usage object a stream sent its client. Feed it complete SSE lines as they
    go out; `observe()` once at the end counts it. A stream carries one only when the
    client asked (`stream_options.include_usage`, as the final chunk; with
    `continuous_usage_stats` every chunk has the running total, so the last one is the
    final count). Lines that do not mention `"usage"` cost one substring search."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: _Answer | None = None

    def feed(self, lines: bytes) -> None:
        """Note the usage in `lines` (whole SSE lines, as relayed), if any."""
        if b'"usage"' not in lines:
            return
        # From the first line that mentions it: a piece may hold many chunks before it.
        lines = lines[lines.rfind(b"\n", 0, lines.find(b'"usage"')) + 1:]
        for line in lines.split(b"\n"):
            if line.startswith(_DATA) and b'"usage"' in line:
                answer = _read_answer(line[len(_DATA):])
                if answer is not None:
                    self._last = answer

    def observe(self, metrics: RouterMetrics) -> None:
        """Count the last usage seen (nothing when the stream carried none); once."""
        last, self._last = self._last, None
        if last is not None:
            metrics.observe_usage(_model_label(last.model), last.usage)


def _count(usage: dict[str, object], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
