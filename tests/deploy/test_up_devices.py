"""`pdgate up --device a,b,...` spreads the engines over devices in start order (one engine
per GPU on a multi-GPU host): each engine process is started with its device, and the
cluster serves. On this CPU machine the devices are `cpu` and `cpu:0` (two names torch
accepts), which is enough to see which process got which."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import child_pids, start_cluster

pytestmark = pytest.mark.slow


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_engines_take_the_listed_devices_in_turn(tiny_model_dir: Path, tmp_path: Path) -> None:
    c = start_cluster(tmp_path, tiny_model_dir, prefill=1, decode=2,
                      extra=["--device", "cpu, cpu:0"])
    try:
        devices = {}
        for pid in child_pids(c.proc.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "pdgate.engine_shim" in argv:
                devices[_flag(argv, "--engine-id")] = _flag(argv, "--device")
        assert devices == {"prefill-0": "cpu", "decode-0": "cpu:0", "decode-1": "cpu"}
        r = httpx.post(f"{c.router}/v1/completions", timeout=60, json={
            "model": c.model, "prompt": "one device each", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert c.stop() == 0


def test_a_device_list_naming_nothing_is_refused() -> None:
    done = subprocess.run([sys.executable, "-m", "pdgate.cli", "up", "--device", " , "],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--device names no device" in done.stderr
