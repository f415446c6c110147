"""The start-up transport probe (real NIXL agents, DRAM on CPU) and the KV transfer bench's
CPU path (two real processes), so CI covers the code the GPU runs use."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.transport_probe import probe_transport, run_probe

ROOT = Path(__file__).resolve().parents[2]


def gauge(m: ShimMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_probe_measures_read_and_write_and_exports_them() -> None:
    m = ShimMetrics.create(CollectorRegistry())
    result = probe_transport("DRAM", 0, m, name="t-ok", min_gbps=0.0)
    assert result is not None
    assert set(result.gbps) == {"read", "write"}
    assert all(g > 0 for g in result.gbps.values())
    assert result.emulated == []
    assert gauge(m, "pdgate_shim_kv_probe_gbps", op="read") == result.gbps["read"]
    assert gauge(m, "pdgate_shim_kv_probe_gbps", op="write") == result.gbps["write"]
    assert gauge(m, "pdgate_shim_kv_probe_emulated") == 0


def test_probe_below_threshold_warns_loudly(caplog: pytest.LogCaptureFixture) -> None:
    m = ShimMetrics.create(CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="pdgate.engine_shim.transport_probe"):
        result = probe_transport("DRAM", 0, m, name="t-slow", min_gbps=float("inf"))
    assert result is not None and result.emulated == ["read", "write"]
    assert gauge(m, "pdgate_shim_kv_probe_emulated") == 1
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "SLOW KV TRANSPORT: READ/WRITE" in warning[0]


def test_run_probe_checks_sizes() -> None:
    result = run_probe("DRAM", 0, name="t-small", nbytes=1 << 16, iters=1)
    assert result.nbytes == 1 << 16 and "DRAM" in result.summary()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_failed_probe_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    m = ShimMetrics.create(CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="pdgate.engine_shim.transport_probe"):
        assert probe_transport("VRAM", 0, m, name="t-fail") is None
    assert "KV transport probe failed" in caplog.text
    assert gauge(m, "pdgate_shim_kv_probe_emulated") == -1
    assert gauge(m, "pdgate_shim_kv_probe_gbps", op="read") is None  # nothing measured


def test_kv_transfer_bench_cpu_path() -> None:
    layers, tokens, bs = 2, (32, 64), 16
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kv_transfer.py"), "--layers", str(layers),
         "--kv-heads", "2", "--head-dim", "16", "--tokens", ",".join(map(str, tokens)),
         "--block-sizes", str(bs), "--iters", "1", "--json"],
        capture_output=True, text=True, timeout=120, check=True, cwd=ROOT,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {(r["op"], r["kv_layout"], r["tokens"]): r for r in result["rows"]}
    assert set(rows) == {(op, lay, t) for op in ("READ", "WRITE") for lay in ("layer", "block")
                         for t in tokens}
    for (_, lay, t), row in rows.items():
        n = t // bs
        regions_per_block = layers * 2 if lay == "layer" else 1  # block-major: one slab
        assert row["per_block"]["descriptors"] == regions_per_block * n
        assert row["coalesced"]["descriptors"] == regions_per_block  # consecutive blocks
        assert row["regions"]["descriptors"] == regions_per_block
        assert row["contiguous"]["descriptors"] == 1
        assert row["device_copy"]["gbps"] > 0
    assert "coalesced" in out.stdout and "device_copy" in out.stdout  # the human table
