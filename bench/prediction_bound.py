"""How close any router-side prediction of TTFT can come, from a router's JSON access log.

The measured-cost decider predicts each request's time to first token from what the router
knows when it decides: the prompt work queued on each engine and rates learned from earlier
requests (router/policies/cost_model.py). Part of its error is the model's; part is the
engine's: a prompt's own service time varies under load (a step shared with another
prompt, KV reads served between steps, the host's scheduler), and no prediction made before
the prompt runs can know it. This script separates the two on a recorded run.

For each request the engine that computed its prompt (its P for "P then D", its D for "D
alone") is taken as a first-come-first-served server: the request's service time is its
first token (P's end, or D's first token) less the later of its arrival and the previous
request's first token on that engine. Two reference predictors are scored on the same
requests, each taking a prompt's service time as the median on that engine for that prompt
length (below / from 256 tokens), medians over the log given:

- *known queue*: knows which prompts were ahead of the request on its engine when it came
  (as the router does, exactly) and how long the one in progress had run; its wait is their
  median services less that, and for "P then D" the transfer and D's first step are their
  median for the prompt length. What a queue model gets with the best constant figures.
- *exact wait*: knows the wait itself, so the services of the prompts ahead too, and the
  transfer and D's first step as they were: everything but the request's own service,
  which is the median. An upper bound: what the engines' own variation leaves to any
  prediction at all.

The decider's own share (`predicted_ttft_s` against `ttft_s`) is printed beside them.

    python bench/prediction_bound.py ROUTER_LOG [ROUTER_LOG ...]

bench/decider.py prints them per phase (its `pred +-25%`, `queue` and `bound` columns).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

LONG_FROM = 256  # prompt tokens: the cost model's first bucket boundary
WITHIN = 0.25


def access_lines(text: Iterable[str]) -> list[dict[str, Any]]:
    """The answered requests' access lines (JSON log format), with `arrival` in seconds."""
    out = []
    for line in text:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict) or not obj.get("access") or obj.get("status") != 200:
            continue
        if obj.get("ttft_s") is None or obj.get("mode") not in ("disagg", "direct"):
            continue
        end = datetime.strptime(obj["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()
        obj["arrival"] = end - obj["duration_s"]
        out.append(obj)
    return out


@dataclass(frozen=True)
class _Served:
    """One request as its prompt's engine served it (first come, first served)."""

    line: dict[str, Any]
    engine: str
    start: float  # the later of its arrival and the previous prompt's first token
    done: float  # its prompt's first token: P's end, or D's first token
    long: bool

    @property
    def service(self) -> float:
        return max(0.0, self.done - self.start)

    @property
    def beyond_prefill(self) -> float:
        """Time to first token after the prompt's engine finished (the transfer and D's
        first step of "P then D"; 0 for "D alone")."""
        return self.line["ttft_s"] - (self.done - self.line["arrival"])


def _served(lines: list[dict[str, Any]]) -> list[_Served]:
    by_engine: dict[str, list[tuple[float, float, dict[str, Any]]]] = {}
    for o in lines:
        disagg = o["mode"] == "disagg" and o.get("prefill_s") is not None
        engine = o["prefill_engine"] if disagg else o["decode_engine"]
        done = o["arrival"] + (o["prefill_s"] if disagg else o["ttft_s"])
        by_engine.setdefault(engine, []).append((o["arrival"], done, o))
    out = []
    for engine, legs in by_engine.items():
        legs.sort(key=lambda leg: leg[0])
        previous = float("-inf")
        for arrival, done, o in legs:
            out.append(_Served(o, engine, max(arrival, previous), done,
                               o["prompt_tokens"] >= LONG_FROM))
            previous = max(previous, done)
    return out


def _known_queue_s(s: _Served, served: list[_Served], typical: dict[tuple[str, bool], float],
                   transfer: dict[bool, float]) -> float:
    """The known-queue prediction of `s`'s TTFT (module docstring)."""
    now = s.line["arrival"]
    ahead = sorted((a for a in served if a.engine == s.engine and a.line["arrival"] < now
                    < a.done), key=lambda a: a.line["arrival"])
    wait = 0.0
    for i, a in enumerate(ahead):
        left = typical[(a.engine, a.long)]
        if i == 0 and a.start <= now:  # in progress: what is left of its typical service
            left = max(0.0, left - (now - a.start))
        wait += left
    disagg = s.line["mode"] == "disagg"
    return wait + typical[(s.engine, s.long)] + (transfer[s.long] if disagg else 0.0)


def _within(ratios: list[float]) -> float | None:
    if not ratios:
        return None
    return sum(1 - WITHIN <= r <= 1 + WITHIN for r in ratios) / len(ratios)


def shares(lines: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """The shares within +-25 % of the exact-wait bound, the known-queue predictor and the
    decider (None when it made no prediction), and how many requests they count."""
    served = _served(lines)
    medians: dict[tuple[str, bool], list[float]] = {}
    for s in served:
        medians.setdefault((s.engine, s.long), []).append(s.service)
    typical = {k: statistics.median(v) for k, v in medians.items()}
    beyond: dict[bool, list[float]] = {}
    for s in served:
        if s.line["mode"] == "disagg":
            beyond.setdefault(s.long, []).append(s.beyond_prefill)
    transfer = {k: statistics.median(v) for k, v in beyond.items()}
    bound, queue, ours = [], [], []
    for s in served:
        ttft = s.line["ttft_s"]
        exact = ttft - s.service + typical[(s.engine, s.long)]
        if exact > 0:
            bound.append(ttft / exact)
        known = _known_queue_s(s, served, typical, transfer)
        if known > 0:
            queue.append(ttft / known)
        if s.line.get("predicted_ttft_s"):
            ours.append(ttft / s.line["predicted_ttft_s"])
    return {"bound_within_25pct": _within(bound), "queue_within_25pct": _within(queue),
            "decider_within_25pct": _within(ours), "requests": len(served),
            "predicted": len(ours)}


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            s = shares(access_lines(f))
        fmt = {k: (f"{100 * v:.0f} %" if isinstance(v, float) else v) for k, v in s.items()}
        print(f"{path}: exact-wait bound {fmt['bound_within_25pct']}, known queue "
              f"{fmt['queue_within_25pct']}, decider {fmt['decider_within_25pct']} within "
              f"+-25 % ({fmt['requests']} requests, {fmt['predicted']} predicted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
