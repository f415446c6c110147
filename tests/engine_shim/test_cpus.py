"""`--cpus`: a shim confined to some cores runs there (the kernel's affinity list of the
process and of every thread, torch's included), answers as usual, and a core list it cannot
use is refused at start. Real `python -m pdgate.engine_shim` processes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.engine_shim.process import MODEL, ROOT, free_port, shim_argv, shim_process


def _allowed(pid: int, tid: str) -> str:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines()
                if line.startswith("Cpus_allowed_list:"))


def test_a_confined_shim_runs_on_its_cores_only(tiny_model_dir: Path) -> None:
    last = max(os.sched_getaffinity(0))
    with shim_process(tiny_model_dir, "--no-kv-transfer", "--cpus", str(last)) as shim:
        done = httpx.post(shim.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "hello", "max_tokens": 4})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        pid = shim.proc.pid
        threads = os.listdir(f"/proc/{pid}/task")
        assert {_allowed(pid, tid) for tid in threads} == {str(last)}


@pytest.mark.parametrize("cpus", ["x", "3-", "-1", "99999"])
def test_a_core_list_it_cannot_use_is_refused(tiny_model_dir: Path, cpus: str) -> None:
    done = subprocess.run(shim_argv(tiny_model_dir, free_port(), "--no-kv-transfer",
                                    "--cpus", cpus),
                          cwd=ROOT, capture_output=True, timeout=120)
    assert done.returncode == 2
    assert "--cpus" in done.stderr.decode()
