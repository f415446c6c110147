"""bench/decider.py runs end to end in CI and prints its table and figures (a small load;
the figures are the bench's business, docs/benchmarks.md: nothing here is timed)."""

from __future__ import annotations

import json
import subprocess
import sys

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
