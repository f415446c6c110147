"""The measured-cost decider's predictor: time to first token of "P then D" and "D alone".

Pure arithmetic over what the router measured; no clock, no I/O, so it is tested on recorded
signals (tests/router/test_cost_model.py). The model, per engine `e` and prompt of `n` tokens:

    prefill time on e  = (n + queued_e) / rate_e(bucket(n))          queued prompts as long
                       = queued_e / rate_e(bucket(m)) + n / rate_e(bucket(n))   otherwise
    TTFT of P then D   = prefill time on the chosen P              + overhead(bucket(n))
    TTFT of D alone    = prefill time on the chosen D (queued_D includes its decode batch)

The decider (router/policies/measured_cost.py) chooses the engine: the least predicted, or
one within its margin, in turn.

`queued_e` is the prompt work ahead of the request on `e` in tokens (`Queue`: the prompts
the router sent there and that have not produced their first token, less what the engine
has computed of the earliest of them, plus what the engine's
own `/metrics` shows beyond that), and `m` the typical length of those queued prompts (the
decider's token-weighted mean prompt length). `rate_e` is a prefill rate in tokens/s learned
per engine and per prompt-length bucket (powers of two from 128 tokens) from the router's
measurements: each P leg's duration, and each direct request's time to first token.
`overhead` is what a disaggregated request takes beyond its P leg (KV transfer and D's first
step), learned per bucket. All three are exponentially weighted moving averages (`alpha`);
an engine or bucket never measured borrows the nearest figure measured: the same bucket on
the other engines (their mean), else the engine's nearest bucket, then `prior_tps`. The
bucket comes first because a short prompt's "rate" is mostly the fixed cost per request and
a long one's the cost per token, a gap of 20x on one engine, while engines serving one
model differ far less: borrowed from the long prompts' bucket of the same engine, the first
64-token prompt on a D was predicted at 1 ms and took 46-51 ms, where the P engines' short
prompts were predicted at 15-21 ms and took 12-17 ms (4x H200 runs, docs/benchmarks.md).

Why two rates: a short prompt's time is mostly the engine's fixed cost per request (a step
of its running batch, HTTP), so its bucket learns a low "rate"; dividing long prompts queued
ahead of it by that rate predicted 0.7 s for what took 0.05 s (2-GPU host, mixed phase).
The queue runs at its own prompts' rate, the request's prompt at its own. A measurement
teaches the request's bucket what is left of it after the queue's predicted time (at least
a quarter of it: a queue can drain faster than predicted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["CostModel", "Queue", "bucket_of"]

_MIN_SECONDS = 1e-4  # a measurement shorter than this is noise (clock resolution)
_TOP_BUCKET = 10  # 128 << 10 = 128k tokens and above share a bucket


def bucket_of(n: int) -> int:
    """The prompt-length bucket of `n` tokens: 0 below 256, then one per doubling."""
    if n < 256:
        return 0
    return min(_TOP_BUCKET, int(math.log2(n / 128)))


@dataclass(frozen=True, slots=True)
class Queue:
    """The prompt work ahead of a new request on one engine, in tokens."""

    key: str  # the endpoint key (router/pool.py)
    tokens: float
    prompt_n: int = 0  # the queued prompts' typical length (0: the request's own)


@dataclass
class _Ewma:
    value: float | None = None

    def add(self, sample: float, alpha: float) -> None:
        self.value = sample if self.value is None else self.value + alpha * (sample - self.value)


@dataclass
class CostModel:
    """Learned prefill rates and overheads; see the module docstring. `alpha` in (0, 1]
    weighs the newest measurement; `prior_tps` is the rate assumed before any."""

    alpha: float = 0.3
    prior_tps: float = 2000.0
    _rates: dict[tuple[str, int], _Ewma] = field(default_factory=dict)
    _overhead: dict[int, _Ewma] = field(default_factory=dict)

    def rate(self, key: str, n: int) -> float:
        """Prefill tokens/s of engine `key` for an `n`-token prompt (never 0)."""
        b = bucket_of(n)
        own = self._rates.get((key, b))
        if own is not None and own.value is not None:
            return own.value
        same = [e.value for (_, kb), e in self._rates.items() if kb == b and e.value is not None]
        if same:
            return sum(same) / len(same)
        mine = [(abs(kb - b), e.value) for (k, kb), e in self._rates.items()
                if k == key and e.value is not None]
        if mine:
            return min(mine)[1]
        return self.prior_tps

    def overhead(self, n: int) -> float:
        """Seconds a disaggregated request takes beyond its P leg (0 until measured)."""
        found = self._overhead.get(bucket_of(n))
        return found.value if found is not None and found.value is not None else 0.0

    def _queue_s(self, q: Queue, n: int) -> float | None:
        """The queue's predicted seconds at its own prompts' rate when that is another
        bucket's than the request's prompt (None: one rate for both)."""
        if q.tokens > 0 and q.prompt_n > 0 and bucket_of(q.prompt_n) != bucket_of(n):
            return q.tokens / self.rate(q.key, q.prompt_n)
        return None

    def prefill_s(self, q: Queue, n: int) -> float:
        """Predicted seconds for engine `q.key` to compute an `n`-token prompt behind
        `q.tokens` queued tokens."""
        queue_s = self._queue_s(q, n)
        if queue_s is not None:
            return queue_s + n / self.rate(q.key, n)
        return (n + q.tokens) / self.rate(q.key, n)

    def learn_prefill(self, q: Queue, n: int, seconds: float) -> None:
        """One measured prefill: `n` prompt tokens behind `q.tokens` took `seconds` on
        `q.key` (a P leg, or a direct request's time to first token)."""
        if seconds < _MIN_SECONDS or n <= 0:
            return
        queue_s = self._queue_s(q, n)
        if queue_s is not None:
            sample = n / max(seconds - queue_s, 0.25 * seconds)
        else:
            sample = (n + q.tokens) / seconds
        self._rates.setdefault((q.key, bucket_of(n)), _Ewma()).add(sample, self.alpha)

    def learn_overhead(self, n: int, seconds: float) -> None:
        """One disaggregated request's time to first token beyond its P leg."""
        self._overhead.setdefault(bucket_of(n), _Ewma()).add(max(0.0, seconds), self.alpha)
