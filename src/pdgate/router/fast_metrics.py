"""Counters, gauges and histograms without locks, exposed exactly as prometheus_client's.

The router records about fifteen metric updates per request. prometheus_client takes a
`threading.Lock` in every `inc`/`set`/`observe` and checks observability on each call:
~7% of the router's CPU behind instant engines. The router updates its metrics from the
event loop only, so a plain float per series is enough; the families below keep those
floats and hand prometheus_client `Metric` families to the registry at scrape time (they
are collectors, registered on the app's `CollectorRegistry`).

The exposition is the same as prometheus_client's `Counter`, `Gauge` and `Histogram` with
the same arguments: family names (a counter's `_total` suffix stripped from its name and
added to its sample), HELP and TYPE lines, label order, the `le` strings of bucket bounds
(+Inf added), cumulative buckets, `_count`/`_sum`, and the `_created` samples (which the
router's `NoCreatedRegistry` drops). tests/router/test_fast_metrics.py compares the two
expositions after the same updates. The API is the subset the router uses: `labels()`,
`remove()`, `clear()`, `inc()`, `dec()`, `set()`, `set_function()`, `observe()`.

Not thread-safe by design: call from the event loop only (as everything in the router
that records metrics does; blocking work in threads records nothing).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

__all__ = ["CounterChild", "FastCounter", "FastGauge", "FastHistogram", "GaugeChild",
           "HistogramChild", "MetricFamily"]

# prometheus_client's own formatting of bucket bounds (untyped in the library).
_go_float: Callable[[float], str] = floatToGoString
_C = TypeVar("_C", "CounterChild", "GaugeChild", "HistogramChild")


class CounterChild:
    """One counter series."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class GaugeChild:
    """One gauge series."""

    __slots__ = ("value", "_function")

    def __init__(self) -> None:
        self.value = 0.0
        self._function: Callable[[], float] | None = None

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def set_function(self, f: Callable[[], float]) -> None:
        """Read the gauge's value from `f()` at each scrape."""
        self._function = f

    def get(self) -> float:
        return float(self._function()) if self._function is not None else self.value


class HistogramChild:
    """One histogram series: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1


class MetricFamily(Generic[_C]):
    """One metric family: its children by label values (in creation order, as
    prometheus_client keeps them), registered on `registry` as a collector."""

    _type = ""
    _sample_suffix = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _C] = {}
        # An unlabelled family has its one series from the start (exposed at zero).
        self._only: _C | None = None if self._labelnames else self._new_child()
        if self._only is not None:
            self._children[()] = self._only
        registry.register(self)

    def _new_child(self) -> _C:
        raise NotImplementedError

    def labels(self, *values: object) -> _C:
        """The child of these label values (created at zero on first use)."""
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if not self._labelnames:
                raise ValueError(f"No label names were set when constructing {self._name}")
            if len(key) != len(self._labelnames):
                raise ValueError(f"Incorrect label count (expected "
                                 f"{len(self._labelnames)}, got {values})")
            child = self._children[key] = self._new_child()
        return child

    def remove(self, *values: object) -> None:
        """Forget one child (KeyError when it does not exist, as prometheus_client)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"Incorrect label count (expected {len(self._labelnames)}, "
                             f"got {values})")
        del self._children[tuple(str(v) for v in values)]

    def clear(self) -> None:
        """Forget every child of a labelled family."""
        if self._labelnames:
            self._children.clear()

    def _unlabelled(self) -> _C:
        if self._only is None:
            raise ValueError(f"{self._name} has labels: call .labels() first")
        return self._only

    def _family(self) -> Metric:
        return Metric(self._name, self._documentation, self._type)

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        metric = self._family()
        for values, child in list(self._children.items()):
            labels = dict(zip(self._labelnames, values, strict=True))
            self._samples(metric, labels, child)
        return [metric]

    def _samples(self, metric: Metric, labels: dict[str, str], child: _C) -> None:
        raise NotImplementedError


class FastCounter(MetricFamily[CounterChild]):
    """prometheus_client's `Counter` (name with or without `_total`)."""

    _type = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames,
                         registry=registry)

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1) -> None:
        self._unlabelled().inc(amount)

    def _samples(self, metric: Metric, labels: dict[str, str], child: CounterChild) -> None:
        metric.add_sample(self._name + "_total", labels, child.value)
        metric.add_sample(self._name + "_created", labels, child.created)


class FastGauge(MetricFamily[GaugeChild]):
    """prometheus_client's `Gauge` (the default `all` multiprocess mode: one process)."""

    _type = "gauge"

    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def inc(self, amount: float = 1) -> None:
        self._unlabelled().inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._unlabelled().dec(amount)

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def set_function(self, f: Callable[[], float]) -> None:
        self._unlabelled().set_function(f)

    def _samples(self, metric: Metric, labels: dict[str, str], child: GaugeChild) -> None:
        metric.add_sample(self._name, labels, child.get())


class FastHistogram(MetricFamily[HistogramChild]):
    """prometheus_client's `Histogram` with `buckets` (sorted; +Inf added when missing)."""

    _type = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        if "le" in labelnames:
            raise ValueError("Invalid label metric name: le")
        self._bounds = tuple(bounds)
        self._les = tuple(_go_float(b) for b in bounds)
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def observe(self, amount: float) -> None:
        self._unlabelled().observe(amount)

    def _samples(self, metric: Metric, labels: dict[str, str],
                 child: HistogramChild) -> None:
        acc = 0.0
        name = self._name
        for le, count in zip(self._les, list(child.counts), strict=True):
            acc += count
            metric.add_sample(name + "_bucket", {**labels, "le": le}, acc)
        metric.add_sample(name + "_count", labels, acc)
        if self._bounds[0] >= 0:
            metric.add_sample(name + "_sum", labels, child.sum)
        metric.add_sample(name + "_created", labels, child.created)
