"""bench/shim_step.py runs in CI on the tiny CPU model and prints a row per batch size and
per new prompt length (the figures are the bench's business, docs/benchmarks.md: nothing
here is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_shim_step_bench_prints_each_batch_and_new_shape() -> None:
    out = subprocess.run(
        [sys.executable, "bench/shim_step.py", "--batches", "1,2", "--tokens", "4", "--reps",
         "2", "--new-shapes", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps = [r for r in rows if "batch" in r]
    shapes = [r for r in rows if "prompt" in r]
    assert [r["batch"] for r in steps] == [1, 2]
    assert all(r["forward_ms"] > 0 and r["step_ms"] > 0 for r in steps)
    assert [r["prompt"] for r in shapes] == [69, 70, 301, 777, 1501]
    assert all(r["first_ms"] > 0 and r["again_ms"] > 0 for r in shapes)
