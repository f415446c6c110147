"""bench/priority.py runs end to end in CI and prints its table (a small load; the figures
are the bench's business, docs/benchmarks.md: nothing here is timed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.cluster import ROOT

pytestmark = pytest.mark.slow


def test_priority_bench_prints_every_setup() -> None:
    out = subprocess.run(
        [sys.executable, "bench/priority.py", "--interactive", "3", "--flood-concurrency", "3",
         "--flood-lead-s", "0.3", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=True).stdout
    table, _, raw = out.partition("\n{")
    assert "| fifo | beside flood |" in table and "| reserved | alone |" in table
    assert "fair: interactive p99 beside the flood / alone" in table
    figures = json.loads("{" + raw)
    for order in ("fifo", "fair", "reserved"):
        assert figures[order]["flood_req_per_s"] > 0
        assert figures[order]["beside_flood"]["latency_p99_ms"] > 0
