"""bench/decider.py runs end to end in CI and prints its table and figures (a small load;
the figures are the bench's business, docs/benchmarks.md: nothing here is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.e2e.cluster import ROOT

pytestmark = pytest.mark.slow


def test_decider_bench_compares_both_deciders() -> None:
    done = subprocess.run(
        [sys.executable, "bench/decider.py", "--burst", "8", "--mixed", "8",
         "--burst-concurrency", "4", "--mixed-concurrency", "2", "--long-tokens", "300",
         "--step-budget", "512",  # engines that take the budget (vLLM's flag)
         "--burst-rate", "20", "--json"],  # the burst open loop: 8 requests in 0.4 s
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    table, _, raw = out.rpartition("\n{")
    for phase in ("burst", "mixed"):
        assert f"{phase}  static" in table and f"{phase}  measured-cost" in table
    figures = json.loads("{" + raw)["decider"]
    for decider in ("static", "measured-cost"):
        for phase in ("burst", "mixed"):
            f = figures[decider][phase]
            assert f["ttft_p90_ms"] > 0 and f["latency_p90_ms"] >= f["ttft_p90_ms"]
            # a stream's longest gap between chunks lies within its request
            assert 0 < f["gap_p90_ms"] <= f["latency_p90_ms"]
            assert sum(f["decisions"].values()) == 8  # every request decided, counted
            assert f["req_per_s"] == pytest.approx(8 / f["seconds"])
    # Only the measured-cost decider predicts; each of its requests is observed.
    assert figures["static"]["burst"]["prediction"]["observed"] == 0
    assert figures["measured-cost"]["burst"]["prediction"]["observed"] == 8
    # The exact-wait bound is read from each phase's own access lines.
    for decider in ("static", "measured-cost"):
        for phase in ("burst", "mixed"):
            bound = figures[decider][phase]["bound"]
            assert bound["requests"] == 8 and 0 <= bound["bound_within_25pct"] <= 1
            assert 0 <= bound["queue_within_25pct"] <= 1
    assert figures["static"]["mixed"]["bound"]["predicted"] == 0
    assert figures["measured-cost"]["mixed"]["bound"]["predicted"] == 8


def _access(t0: datetime, arrival_s: float, ttft_s: float, predicted_s: float) -> str:
    duration = ttft_s + 0.01
    ts = (t0 + timedelta(seconds=arrival_s + duration)).strftime("%Y-%m-%dT%H:%M:%S.%f")
    return json.dumps({
        "ts": ts[:-3] + "Z", "access": True, "status": 200, "duration_s": duration,
        "mode": "direct", "ttft_s": ttft_s, "prefill_s": None, "prompt_tokens": 1500,
        "predicted_ttft_s": predicted_s, "prefill_engine": None,
        "decode_engine": "http://127.0.0.1:9"})


def test_prediction_bound_takes_each_service_as_the_engines_median(tmp_path: Path) -> None:
    """Four prompts sent 1 ms apart to one engine, served first come first served in 0.1,
    0.3, 0.1 and 0.1 s (first tokens at 0.1, 0.4, 0.5 and 0.6 s). With the median service
    (0.1 s), an exact-wait predictor misses only the slow one (0.4 s for 0.2 s): 3 of 4; a
    known-queue one counts 0.1 s for each prompt ahead and misses the slow one and the two
    behind it (0.5 s for 0.3 s, 0.6 s for 0.4 s): 1 of 4; the decider's logged predictions
    hit 2 of 4."""
    t0 = datetime(2026, 11, 29, tzinfo=UTC)
    firsts = [0.1, 0.4, 0.5, 0.6]
    predicted = [0.2, 0.1, 0.5, 0.6]
    log = tmp_path / "router.log"
    log.write_text("not json\n" + "\n".join(
        _access(t0, i / 1000, f - i / 1000, p - i / 1000)
        for i, (f, p) in enumerate(zip(firsts, predicted, strict=True))))
    done = subprocess.run([sys.executable, "bench/prediction_bound.py", str(log)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("exact-wait bound 75 %, known queue 25 %, decider 50 % within +-25 % "
            "(4 requests, 4 predicted)") in done.stdout, done.stdout
