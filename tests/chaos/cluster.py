"""A local P/D cluster of real processes whose engines can be killed, frozen and restarted.

Unlike `pdgate up` (which stops the whole cluster when a child dies), every engine here is
its own child of the test process, so a test can `kill -9`, `SIGSTOP`/`SIGCONT` or restart
one engine by PID while the router keeps serving. Router and engines run with short
deadlines (seconds, not minutes) so that every fault resolves quickly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine_shim.tiny import TINY_MODEL_NAME
from tests.e2e.cluster import ROOT, free_port_range, metric

LEASE_S = 3.0
# The router's deadlines: every wait is bounded, well below the clients' own timeout.
ROUTER_FLAGS = [
    "--connect-timeout-s", "1", "--prefill-timeout-s", "2", "--decode-first-byte-timeout-s",
    "20", "--decode-idle-timeout-s", "15", "--health-interval-s", "0.3", "--health-timeout-s",
    "0.5", "--health-failure-threshold", "1", "--eject-consecutive-errors", "2",
    "--breaker-open-s", "2", "--max-retries", "2", "--retry-backoff-s", "0.02",
    "--kv-abort-timeout-s", "1", "--log-level", "warning",
]


@dataclass
class Engine:
    """One shim engine process (restartable on the same ports)."""

    name: str
    role: str
    port: int
    side_port: int
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=out, stderr=out)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)  # by PID: only the process this test started

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)  # a frozen engine cannot handle SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class ChaosCluster:
    """Engines plus a router in front of them, all children of the test process."""

    router_port: int
    engines: list[Engine]
    router_argv: list[str]
    log_dir: Path
    router: subprocess.Popen[bytes] | None = None
    model: str = TINY_MODEL_NAME
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def by_role(self, role: str) -> list[Engine]:
        return [e for e in self.engines if e.role == role]

    def revive(self) -> None:
        """Restart any engine that is not running (a scenario that failed half-way must not
        break the next one) and wait until the router routes to all of them."""
        for e in self.engines:
            if e.proc is None or e.proc.poll() is not None:
                e.stop()
                e.start()
                wait_healthy(e, 120)
            else:
                os.kill(e.proc.pid, signal.SIGCONT)
        wait_router_pairs(self, len(self.by_role("prefill")), len(self.by_role("decode")))

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        for e in self.engines:
            e.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.log_dir.glob("*.log")))


def start_chaos_cluster(tmp: Path, model_dir: Path, *, prefill: int = 2, decode: int = 2,
                        timeout: float = 120.0) -> ChaosCluster:
    """Start `prefill` + `decode` shim engines and a router; return once the router is
    ready and every engine answers /health."""
    n = prefill + decode
    base = free_port_range(2 * n + 1)
    log_dir = tmp / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    engines = []
    for i in range(n):
        role = "prefill" if i < prefill else "decode"
        name = f"{role}-{i if i < prefill else i - prefill}"
        port, side = base + 1 + i, base + 1 + n + i
        argv = [sys.executable, "-m", "engine_shim", "--model", str(model_dir),
                "--served-model-name", TINY_MODEL_NAME, "--host", "127.0.0.1",
                "--port", str(port), "--block-size", "4", "--num-blocks", "256",
                "--engine-id", name, "--side-channel-host", "127.0.0.1",
                "--side-channel-port", str(side), "--kv-lease-seconds", str(LEASE_S)]
        engines.append(Engine(name, role, port, side, argv, log_dir / f"{name}.log"))
    router_argv = [sys.executable, "-m", "router", "--host", "127.0.0.1",
                   "--port", str(base), "--model", str(model_dir),
                   "--served-model-name", TINY_MODEL_NAME, *ROUTER_FLAGS]
    for e in engines:
        router_argv += [f"--{e.role}", e.url]
    cluster = ChaosCluster(base, engines, router_argv, log_dir)
    try:
        for e in engines:
            e.start()
        for e in engines:
            wait_healthy(e, timeout)
        with (log_dir / "router.log").open("ab") as out:
            cluster.router = subprocess.Popen(router_argv, cwd=ROOT, stdout=out, stderr=out)
        wait_router_pairs(cluster, prefill, decode, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_healthy(engine: Engine, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.proc is not None and engine.proc.poll() is not None:
            raise RuntimeError(f"{engine.name} exited: {engine.log.read_text()[-3000:]}")
        try:
            if httpx.get(engine.url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{engine.name} not healthy after {timeout}s")


def wait_router_pairs(cluster: ChaosCluster, prefill: int, decode: int,
                      timeout: float = 30.0) -> None:
    """Wait until the router counts `prefill` and `decode` healthy engines."""
    deadline = time.monotonic() + timeout
    body: dict[str, object] = {}
    while time.monotonic() < deadline:
        try:
            body = httpx.get(cluster.url + "/ready", timeout=1.0).json()
            if (body.get("prefill_healthy"), body.get("decode_healthy")) == (prefill, decode):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"router never saw {prefill}P/{decode}D: {body}\n{cluster.logs()}")


def pools_full(engines: list[Engine], timeout: float) -> list[tuple[float, float, float]]:
    """Wait until every engine's block pool is entirely free (nothing leased); return the
    last (free, total, leased) per engine either way."""
    deadline = time.monotonic() + timeout
    states: list[tuple[float, float, float]] = []
    while time.monotonic() < deadline:
        states = [(metric(e.url, "pdgate_shim_kv_blocks_free"),
                   metric(e.url, "pdgate_shim_kv_blocks_total"),
                   metric(e.url, "pdgate_shim_kv_blocks_leased")) for e in engines]
        if all(free == total and leased == 0 for free, total, leased in states):
            return states
        time.sleep(0.3)
    return states
