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
request's first token on that engine. An *exact-wait* predictor knows everything that
happened before the request's service began — the wait, and for "P then D" the transfer and
D's first step — and only the service itself it takes as the median on that engine for
that prompt length (below / from 256 tokens). Its share within +-25 % is an upper bound for
a predictor that knows the queue perfectly but not the future; the decider's own share
(`predicted_ttft_s` against `ttft_s`) is printed beside it.

    python bench/prediction_bound.py ROUTER_LOG [ROUTER_LOG ...]

bench/decider.py prints both per phase (its `pred +-25%` and `bound` columns).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable
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


def _services(lines: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str, float]]:
    """(line, engine that computed the prompt, FCFS service seconds) per request."""
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
            out.append((o, engine, max(0.0, done - max(arrival, previous))))
            previous = max(previous, done)
    return out


def _within(ratios: list[float]) -> float | None:
    if not ratios:
        return None
    return sum(1 - WITHIN <= r <= 1 + WITHIN for r in ratios) / len(ratios)


def shares(lines: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """The exact-wait bound's share within +-25 %, the decider's own (None when it made no
    prediction), and how many requests each counts."""
    served = _services(lines)
    medians: dict[tuple[str, bool], list[float]] = {}
    for o, engine, service in served:
        medians.setdefault((engine, o["prompt_tokens"] >= LONG_FROM), []).append(service)
    typical = {k: statistics.median(v) for k, v in medians.items()}
    bound, ours = [], []
    for o, engine, service in served:
        predicted = o["ttft_s"] - service + typical[(engine, o["prompt_tokens"] >= LONG_FROM)]
        if predicted > 0:
            bound.append(o["ttft_s"] / predicted)
        if o.get("predicted_ttft_s"):
            ours.append(o["ttft_s"] / o["predicted_ttft_s"])
    return {"bound_within_25pct": _within(bound), "decider_within_25pct": _within(ours),
            "requests": len(bound), "predicted": len(ours)}


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            s = shares(access_lines(f))
        fmt = {k: (f"{100 * v:.0f} %" if isinstance(v, float) else v) for k, v in s.items()}
        print(f"{path}: exact-wait bound {fmt['bound_within_25pct']}, decider "
              f"{fmt['decider_within_25pct']} within +-25 % ({fmt['requests']} requests, "
              f"{fmt['predicted']} predicted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
