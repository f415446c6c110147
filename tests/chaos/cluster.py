"""A local P/D cluster of real processes whose engines can be killed, frozen and restarted.

Unlike `pdgate up` (which stops the whole cluster when a child dies), every engine here is
its own child of the test process, so a test can `kill -9`, `SIGSTOP`/`SIGCONT` or restart
one engine by PID while the router keeps serving. Router and engines run with short
deadlines (seconds, not minutes) so that every fault resolves quickly.

The engines do not depend on the P/D mode (the router tells them per request), so one set
of engines serves every mode: `start_engines` once, then `start_router(mode)` per mode
(a router starts in seconds, four engines on two cores in far more).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdgate.engine_shim.tiny import TINY_MODEL_NAME
from tests.e2e.cluster import ROOT, free_port_range, metric

LEASE_S = 3.0
# KV-ready deadline (notify) and push deadline (push): a notice that never comes costs this.
KV_READY_TIMEOUT_S = 3.0
# Router and engines sign / check KV-ready notices with this (notify mode).
NOTIFY_SECRET = "chaos-notify-secret-0123456789"
# The router's deadlines: every wait is bounded, well below the clients' own timeout.
ROUTER_FLAGS = [
    "--connect-timeout-s", "1", "--prefill-timeout-s", "2", "--decode-first-byte-timeout-s",
    "20", "--decode-idle-timeout-s", "15", "--health-interval-s", "0.3", "--health-timeout-s",
    "0.5", "--health-failure-threshold", "1", "--eject-consecutive-errors", "2",
    "--breaker-open-s", "2", "--max-retries", "2", "--retry-backoff-s", "0.02",
    "--kv-abort-timeout-s", "1", "--kv-ready-timeout-s", str(KV_READY_TIMEOUT_S),
    "--notify-secret", NOTIFY_SECRET, "--log-level", "warning",
]
# The engines' KV deadlines, short like the router's: a READ from a frozen prefill engine
# must fail (and the decode engine recompute) well before the router's decode first-byte
# deadline, else the decode leg times out at the router (engine default: 30 s > 20 s).
ENGINE_FLAGS = [
    "--kv-lease-seconds", str(LEASE_S), "--kv-transfer-timeout", "5",
    "--kv-handshake-timeout", "3", "--kv-landing-timeout", "5",
    "--notify-secret", NOTIFY_SECRET,
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
    extra: list[str] = field(default_factory=list)  # flags of this run on top of argv

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, extra: list[str] | None = None) -> None:
        """Start the process; `extra` flags come last (argparse: the last one wins)."""
        assert not self.running, f"{self.name} runs already"
        self.extra = list(extra or [])
        with self.log.open("ab") as out:
            out.write(f"=== start {' '.join(self.extra)}\n".encode())
            self.proc = subprocess.Popen(self.argv + self.extra, cwd=ROOT, stdout=out,
                                         stderr=out)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)  # by PID: only the process this test started

    def kill(self) -> None:
        """`kill -9`, and reap it."""
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)  # a frozen engine cannot handle SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, extra: list[str] | None = None) -> None:
        """A new process (new NIXL agent) on the same HTTP and side-channel ports."""
        self.stop()
        self.start(extra)


@dataclass
class ChaosCluster:
    """Engines plus a router in one P/D mode in front of them, all children of the test."""

    mode: str
    router_port: int
    engines: list[Engine]
    router_argv: list[str]
    log_dir: Path
    router: subprocess.Popen[bytes] | None = None
    model: str = TINY_MODEL_NAME

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def by_role(self, role: str) -> list[Engine]:
        return [e for e in self.engines if e.role == role]

    def revive(self) -> None:
        """Restart any engine that is not running or runs with a test's extra flags, thaw
        the rest (a scenario that failed half-way must not break the next one), and wait
        until the router routes to all of them."""
        restarted = []
        for e in self.engines:
            if not e.running or e.extra:
                e.restart()
                restarted.append(e)
            else:
                e.signal(signal.SIGCONT)
        for e in restarted:
            wait_healthy(e, 120)
        wait_router_pairs(self, len(self.by_role("prefill")), len(self.by_role("decode")))

    def stop(self) -> None:
        """Stop the router (the engines belong to whoever started them)."""
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.log_dir.glob("*.log")))


def start_engines(tmp: Path, model_dir: Path, *, prefill: int = 2, decode: int = 2,
                  timeout: float = 180.0) -> tuple[list[Engine], int]:
    """Start `prefill` + `decode` shim engines (all at once) and wait until every one
    answers /health. Returns them and a free port for the router."""
    n = prefill + decode
    base = free_port_range(2 * n + 1)
    log_dir = tmp / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    engines = []
    for i in range(n):
        role = "prefill" if i < prefill else "decode"
        name = f"{role}-{i if i < prefill else i - prefill}"
        port, side = base + 1 + i, base + 1 + n + i
        argv = [sys.executable, "-m", "pdgate.engine_shim", "--model", str(model_dir),
                "--served-model-name", TINY_MODEL_NAME, "--host", "127.0.0.1",
                "--port", str(port), "--block-size", "4", "--num-blocks", "256",
                "--engine-id", name, "--side-channel-host", "127.0.0.1",
                "--side-channel-port", str(side), *ENGINE_FLAGS]
        engines.append(Engine(name, role, port, side, argv, log_dir / f"{name}.log"))
    try:
        for e in engines:
            e.start()
        for e in engines:
            wait_healthy(e, timeout)
    except BaseException:
        stop_engines(engines)
        raise
    return engines, base


def stop_engines(engines: list[Engine]) -> None:
    """Stop them all at once (each takes seconds to shut down gracefully)."""
    running = [e for e in engines if e.running]
    for e in running:
        e.signal(signal.SIGCONT)  # a frozen engine cannot handle SIGTERM
        e.signal(signal.SIGTERM)
    for e in running:
        e.stop()  # waits (and kills one that does not stop)


def start_router(engines: list[Engine], port: int, model_dir: Path, mode: str, *,
                 timeout: float = 120.0, extra: list[str] | None = None) -> ChaosCluster:
    """A router in `mode` (pull, notify or push) in front of `engines` (`extra`: more
    router flags); returns once it counts every engine healthy."""
    log_dir = engines[0].log.parent
    argv = [sys.executable, "-m", "pdgate.router", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(model_dir), "--served-model-name", TINY_MODEL_NAME,
            "--pd-mode", mode, *ROUTER_FLAGS, *(extra or [])]
    for e in engines:
        argv += [f"--{e.role}", e.url]
    cluster = ChaosCluster(mode, port, engines, argv, log_dir)
    try:
        with (log_dir / "router.log").open("ab") as out:
            out.write(f"=== router --pd-mode {mode}\n".encode())
            cluster.router = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=out)
        wait_router_pairs(cluster, len(cluster.by_role("prefill")),
                          len(cluster.by_role("decode")), timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextmanager
def paced(engine: Engine, run_s: float = 0.005, stop_s: float = 0.015) -> Iterator[None]:
    """Let `engine` run `run_s` of every `run_s + stop_s` seconds (SIGSTOP/SIGCONT) while
    the block runs: a slow decode engine. The kill tests fire their kill from a client that
    reads behind the router, or from a poll of the engine's counters; on a loaded 2-core
    machine the tiny model at full speed could finish every stream the kill was meant to
    cut before it landed (CI at 3e8f182: "no migration was counted" in two tests). A kill
    during a stopped interval ends the pacing; the signals go through a pidfd, never to a
    reused PID."""
    assert engine.proc is not None
    pidfd = os.pidfd_open(engine.proc.pid)
    done = threading.Event()

    def pace() -> None:
        try:
            while not done.is_set():
                signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
                done.wait(stop_s)
                signal.pidfd_send_signal(pidfd, signal.SIGCONT)
                done.wait(run_s)
        except ProcessLookupError:  # killed: nothing left to pace
            pass

    thread = threading.Thread(target=pace, name=f"pace-{engine.name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGCONT)
        except ProcessLookupError:
            pass
        os.close(pidfd)


def restart_down(engines: list[Engine]) -> None:
    """Restart each engine that is not running (or runs with a test's extra flags: an
    earlier scenario's) and wait until it is healthy."""
    restarted = [e for e in engines if not e.running or e.extra]
    for e in restarted:
        e.restart()
    for e in restarted:
        wait_healthy(e, 120)


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
        if cluster.router is not None and cluster.router.poll() is not None:
            raise RuntimeError(f"router exited:\n{cluster.logs()}")
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
                   metric(e.url, "pdgate_shim_kv_blocks_capacity"),
                   metric(e.url, "pdgate_shim_kv_blocks_leased")) for e in engines]
        if all(free == total and leased == 0 for free, total, leased in states):
            return states
        time.sleep(0.3)
    return states
