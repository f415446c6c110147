"""A shim as a real `python -m pdgate.engine_shim` process on a free port (tests that need
its own event loop, its RSS, or its command line)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def _base_env() -> dict[str, str]:
    """PATH, and PYTHONPATH when set (a test run against another source tree)."""
    return {k: v for k in ("PATH", "PYTHONPATH")
            if (v := os.environ.get(k, "/usr/bin:/bin" if k == "PATH" else ""))}


@dataclass
class ShimProcess:
    url: str
    proc: subprocess.Popen[bytes]

    def rss_bytes(self) -> int:
        """Resident set size now (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shim_argv(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pdgate.engine_shim", "--model", str(model_dir),
            "--served-model-name", MODEL, "--port", str(port), "--log-level", "warning",
            *extra]


@contextmanager
def shim_process(model_dir: Path, *extra: str, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None, stderr: Path | None = None,
                 startup_s: float = 120.0) -> Iterator[ShimProcess]:
    """Start a shim with `extra` flags (its stderr into the file `stderr` when given), wait
    for GET /health (reached on 127.0.0.1), yield it, then SIGTERM it (killed if it does
    not exit within 30 s)."""
    port = free_port()
    err = None if stderr is None else stderr.open("wb")
    proc = subprocess.Popen(
        shim_argv(model_dir, port, "--host", host, *extra), cwd=ROOT, stderr=err,
        env={**_base_env(), **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None, f"the shim exited during startup ({proc.returncode})"
            assert time.monotonic() < deadline, "the shim did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield ShimProcess(url, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if err is not None:
            err.close()
