"""Prometheus metrics of the KV-ready proxy (`pdgate_proxy_` prefix) on an injected registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdgate.common.metrics_registry import NoCreatedRegistry

_P = "pdgate_proxy_"


# Wake latency is tens of microseconds when healthy; the fine low buckets make p50/p99
# readable from the exposition, the tail ones show event-loop stalls.
WAKE_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.5,
)

# Why a well-formed, authenticated notice was refused (see proxy.waiters).
RejectReason = Literal["token_mismatch", "replay", "unknown_waiter"]
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)


@dataclass(frozen=True)
class ProxyMetrics:
    """Built once per proxy (or per test) and passed to the server and the waiter table.

    Metric families:
    - ``messages_total{kind,result}``: every received frame; result is the transfer status
      (``ok``/``failed``) for accepted notifications, ``ok`` for heartbeats, or why it was
      dropped: a `WireError` reason (``malformed``, ``too_large``, ``bad_version``,
      ``unknown_kind``, ``bad_mac``), a `RejectReason`, or ``error`` (a bug, logged).
    - ``notifications_rejected_total{reason}``: authenticated notices refused by the waiter
      table: ``token_mismatch`` (not the token its waiter was registered with; also counted
      when a tokened waiter discards a held early arrival), ``replay`` (its waiter already
      took a notice), ``unknown_waiter`` (no waiter will take it: finished, or a tokened
      notice for an id never registered).
    - ``waiters`` / ``early_arrivals`` / ``early_arrival_bytes`` / ``finished_requests``:
      table sizes (read at scrape); the last is the finished request ids remembered.
    - ``early_notifications_total``: notifications stored before their waiter existed.
    - ``reaped_total{what}``: TTL expiries of early arrivals / abandoned waiters.
    - ``evictions_total{reason}``: early arrivals dropped to respect the count / bytes caps.
    - ``waits_total{outcome}``: ``ready``, ``failed``, ``timeout``, ``cancelled``, ``rejected``.
    - ``wake_latency_seconds``: message received -> suspended waiter resumed.
    """

    registry: CollectorRegistry
    messages: Counter
    waiters: Gauge
    early_arrivals: Gauge
    early_arrival_bytes: Gauge
    early_arrivals_total: Counter
    rejected: Counter
    finished: Gauge
    reaped: Counter
    evictions: Counter
    waits: Counter
    wake_latency: Histogram
    _children: dict[tuple[str, str], Counter] = field(default_factory=dict, compare=False)
    _rejected: dict[str, Counter] = field(default_factory=dict, compare=False)

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ProxyMetrics:
        reg = registry if registry is not None else NoCreatedRegistry()
        return cls(
            registry=reg,
            messages=Counter(
                _P + "messages", "Frames received, by message kind and result",
                ["kind", "result"], registry=reg,
            ),
            waiters=Gauge(_P + "waiters", "Registered KV-ready waiters", registry=reg),
            early_arrivals=Gauge(
                _P + "early_arrivals", "Notifications held for a waiter not yet registered",
                registry=reg,
            ),
            early_arrival_bytes=Gauge(
                _P + "early_arrival_bytes", "Payload bytes of held early arrivals", registry=reg
            ),
            early_arrivals_total=Counter(
                _P + "early_notifications", "Notifications that arrived before their waiter",
                registry=reg,
            ),
            rejected=Counter(
                _P + "notifications_rejected", "Authenticated notices refused, by reason",
                ["reason"], registry=reg,
            ),
            finished=Gauge(
                _P + "finished_requests",
                "Finished request ids remembered to refuse late and replayed notices",
                registry=reg,
            ),
            reaped=Counter(
                _P + "reaped", "Entries dropped after their TTL", ["what"], registry=reg
            ),
            evictions=Counter(
                _P + "evictions", "Early arrivals evicted (oldest first) to respect a cap",
                ["reason"], registry=reg,
            ),
            waits=Counter(_P + "waits", "Finished waits, by outcome", ["outcome"], registry=reg),
            wake_latency=Histogram(
                _P + "wake_latency_seconds", "Notification received -> waiter resumed",
                buckets=WAKE_BUCKETS, registry=reg,
            ),
        )

    def __post_init__(self) -> None:
        for reason in REJECT_REASONS:  # exported at 0 from the start, for alert rules
            self._reject_child(reason)

    def _reject_child(self, reason: RejectReason) -> Counter:
        """The cached ``notifications_rejected_total`` child for `reason`."""
        child = self._rejected.get(reason)
        if child is None:
            child = self._rejected[reason] = self.rejected.labels(reason)
        return child

    def message(self, kind: str, result: str, n: int = 1) -> None:
        """Count `n` received frames (hot path: the labelled child is cached)."""
        child = self._children.get((kind, result))
        if child is None:
            child = self._children[(kind, result)] = self.messages.labels(kind, result)
        child.inc(n)

    def reject(self, reason: RejectReason) -> None:
        """Count one refused notice (hot path under a replay flood: children are cached)."""
        self._reject_child(reason).inc()

    def watch_sizes(
        self, waiters: Callable[[], float], early: Callable[[], float],
        early_bytes: Callable[[], float], *, finished: Callable[[], float] | None = None,
    ) -> None:
        """Make the size gauges read the table at scrape time (nothing on the hot path)."""
        self.waiters.set_function(waiters)
        self.early_arrivals.set_function(early)
        self.early_arrival_bytes.set_function(early_bytes)
        if finished is not None:
            self.finished.set_function(finished)
