"""`pdgate router --workers N`: real router processes on one port in front of fake engines.

The fake engines (tests/router/fake_engine.py) run in the test's event loop on loopback
sockets; the router is a real `python -m pdgate.router --workers 2` process tree. Each response
names the worker that served it (`X-Pdgate-Worker`); new connections are spread by the
kernel (SO_REUSEPORT), so a test sends requests on fresh connections until it has seen
both workers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from pdgate.router.config import RouterConfig
from pdgate.router.http.workers import split_limit, worker_config
from pdgate.router.worker_metrics import DIR_ENV, INDEX_ENV
from tests.drain_probes import wait_for_drain
from tests.router.conftest import MODEL
from tests.router.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_port_pair() -> int:
    """A port p such that p and p + 1 are both free (worker i binds the notify port + i),
    below the ephemeral range so no outgoing connection takes p + 1 meanwhile."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(c) for c in (task / "children").read_text().split())
    return found


class RouterTree:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc, self.url = proc, url

    async def post(self, body: dict[str, Any], timeout: float = 30.0) -> httpx.Response:
        # A client per request: a new connection, which the kernel may give any worker.
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await client.post(self.url + "/v1/completions", json=body)

    async def until_both_workers(self, body: dict[str, Any]) -> list[httpx.Response]:
        replies: list[httpx.Response] = []
        while {r.headers.get("x-pdgate-worker") for r in replies} != {"0", "1"}:
            assert len(replies) < 200, "200 fresh connections all reached one worker"
            replies.append(await self.post(body))
        return replies


@pytest.fixture
async def start_tree(tiny_model_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    trees: list[RouterTree] = []

    async def start(p: FakeEngine, d: FakeEngine, *extra: str) -> RouterTree:
        port = _free_port()
        argv = [sys.executable, "-m", "pdgate.router", "--workers", "2", "--port", str(port),
                "--model", str(tiny_model_dir), "--served-model-name", MODEL,
                "--prefill", p.url, "--decode", d.url, "--prefill-policy", "round-robin",
                "--decode-policy", "round-robin", "--log-level", "warning", *extra]
        tree = RouterTree(subprocess.Popen(argv, cwd=ROOT), f"http://127.0.0.1:{port}")
        trees.append(tree)
        # Both workers up: each has answered /ready with 200. Counting successes in a row
        # is not enough: a worker listens only once its lifespan is up, and until then the
        # kernel sends every connection to the other one.
        ready: set[str] = set()
        async with httpx.AsyncClient(timeout=2.0) as client:
            for _ in range(3000):
                assert tree.proc.poll() is None, "router exited during startup"
                try:
                    resp = await client.get(tree.url + "/ready", headers={"Connection": "close"})
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
                    continue
                if resp.is_success:
                    ready.add(resp.headers["x-pdgate-worker"])
                if ready == {"0", "1"} and len(_children(tree.proc.pid)) == 2:
                    return tree
                await asyncio.sleep(0.02)
        raise AssertionError(f"router workers not ready (ready: {sorted(ready)})")

    yield start
    for tree in trees:
        if tree.proc.poll() is None:
            tree.proc.send_signal(signal.SIGTERM)
            tree.proc.wait(30)


BODY = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3}
DRAIN_S = 8.0  # long enough for the checks below on a loaded 2-core machine


async def test_both_workers_serve_one_port_a_dead_one_is_replaced_sigterm_stops_all(
    make_engine: Callable[..., Any], start_tree: Callable[..., Any]
) -> None:
    p, d = await make_engine(engine_id="p"), await make_engine(engine_id="d")
    tree = await start_tree(p, d)
    workers = _children(tree.proc.pid)
    assert len(workers) == 2

    replies = await tree.until_both_workers(BODY)

    assert all(r.status_code == 200 for r in replies)
    assert all(r.json()["choices"][0]["text"] == "Hello world!" for r in replies)
    assert len(p.prefills) == len(d.decodes) == len(replies)  # pull: both legs every time
    # A worker that dies is replaced (after a short backoff); the other keeps serving.
    victim = min(workers)
    os.kill(victim, signal.SIGKILL)
    for _ in range(300):
        now = _children(tree.proc.pid)
        if len(now) == 2 and victim not in now:
            break
        await asyncio.sleep(0.1)
    workers = _children(tree.proc.pid)
    assert len(workers) == 2 and victim not in workers
    assert (await tree.post(BODY)).status_code == 200
    tree.proc.send_signal(signal.SIGTERM)
    assert tree.proc.wait(30) == 0
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


async def test_sigterm_drains_every_worker_then_the_tree_exits_0(
    make_engine: Callable[..., Any], start_tree: Callable[..., Any]
) -> None:
    """The parent passes SIGTERM on: every worker's /ready fails within seconds (20 fresh
    connections, spread over both), both still serve, and the tree exits 0 after the
    delay (router/http/drain.py)."""
    p, d = await make_engine(engine_id="p"), await make_engine(engine_id="d")
    tree = await start_tree(p, d, "--drain-delay-s", str(DRAIN_S))
    sent = time.monotonic()
    tree.proc.send_signal(signal.SIGTERM)
    # Every worker's /ready fails within 5 s of the signal (tests/drain_probes.py).
    await asyncio.to_thread(wait_for_drain, tree.url + "/ready", sent)
    replies = [await tree.post(BODY) for _ in range(6)]
    assert time.monotonic() - sent < DRAIN_S  # all sent while draining
    assert [r.status_code for r in replies] == [200] * 6
    assert all(r.headers["connection"] == "close" for r in replies)
    assert tree.proc.wait(30) == 0
    assert time.monotonic() - sent >= DRAIN_S


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (its SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


async def test_a_worker_stopped_while_it_starts_comes_up_draining_and_exits_0(
    make_engine: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM to a worker before it has even read its settings (its parent stopped, or
    Kubernetes deleted the pod, while it started) is not lost: the worker comes up already
    draining (/ready 503 "draining", requests served with Connection: close) and exits 0
    once the delay, counted from the signal, is over. It used to come up serving as if
    nothing had happened, never drain, and be killed by its parent."""
    from pdgate.router.cli import config_from_args

    p, d = await make_engine(engine_id="p"), await make_engine(engine_id="d")
    port = _free_port()
    config = config_from_args(["--port", str(port), "--model", str(tiny_model_dir),
                               "--served-model-name", MODEL, "--prefill", p.url,
                               "--decode", d.url, "--drain-delay-s", "10"])
    env = {**os.environ, DIR_ENV: str(tmp_path), INDEX_ENV: "0"}
    proc = subprocess.Popen([sys.executable, "-m", "pdgate.router.http.workers", "0"],
                            stdin=subprocess.PIPE, cwd=ROOT, env=env)
    try:
        for _ in range(300):  # the worker waits for its settings on stdin
            if _catches(proc.pid, signal.SIGTERM):
                break
            assert proc.poll() is None, "worker exited before reading its settings"
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the worker never handled SIGTERM before reading its settings")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(worker_config(config, 0)))
        proc.stdin.close()
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                assert time.monotonic() - sent < 10.0, "the worker did not serve during its drain"
                try:
                    ready = await client.get(url + "/ready", headers={"Connection": "close"})
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
                    continue
                break
            reply = await client.post(url + "/v1/completions", json=BODY)
        assert (ready.status_code, ready.json()["status"]) == (503, "draining")
        assert reply.status_code == 200 and reply.headers["connection"] == "close"
        assert await asyncio.to_thread(proc.wait, 30) == 0
        assert time.monotonic() - sent >= 10.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_notify_mode_notices_reach_the_worker_that_waits(
    make_engine: Callable[..., Any], start_tree: Callable[..., Any]
) -> None:
    p, d = await make_engine(engine_id="p"), await make_engine(engine_id="d")
    notify_port = _free_port_pair()
    tree = await start_tree(p, d, "--pd-mode", "notify", "--notify-bind",
                            f"tcp://127.0.0.1:{notify_port}", "--kv-ready-timeout-s", "5",
                            "--no-early-first-token")

    replies = await tree.until_both_workers(BODY)

    assert [r.status_code for r in replies] == [200] * len(replies)
    # Each worker advertised its own proxy (notify port + worker index) to P.
    advertised = {r.body["kv_transfer_params"]["notify_endpoint"] for r in p.prefills}
    assert advertised == {f"tcp://127.0.0.1:{notify_port}", f"tcp://127.0.0.1:{notify_port + 1}"}


async def test_admission_slots_are_divided_between_workers(
    make_engine: Callable[..., Any], start_tree: Callable[..., Any]
) -> None:
    p, d = await make_engine(engine_id="p"), await make_engine(engine_id="d", delay_s=3.0)
    # 2 slots, no queue, 2 workers: one slot each. Six requests at once put at least three
    # on one worker, so undivided limits (2 each) would admit two on the same worker.
    tree = await start_tree(p, d, "--max-concurrent-requests", "2",
                            "--max-queued-requests", "0")

    replies = await asyncio.gather(*(tree.post(BODY) for _ in range(6)))

    admitted = [r.headers["x-pdgate-worker"] for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(admitted) + len(refused) == 6
    assert 1 <= len(admitted) <= 2 and len(set(admitted)) == len(admitted)
    assert all(r.json()["error"]["type"] for r in refused)


@pytest.mark.parametrize(("total", "minimum", "shares"), [
    (1024, 1, [342, 341, 341]),
    (2, 1, [1, 1, 1]),  # fewer slots than workers: each still gets one
    (0, 0, [0, 0, 0]),  # no queue stays no queue
    (7, 0, [3, 2, 2]),
])
def test_split_limit_adds_up(total: int, minimum: int, shares: list[int]) -> None:
    assert [split_limit(total, 3, i, minimum) for i in range(3)] == shares


def test_worker_config_offsets_the_notify_port() -> None:
    base = RouterConfig(model="m", prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"])
    config = msgspec.structs.replace(base, workers=3, notify_bind="tcp://0.0.0.0:7500",
                                     max_concurrent_requests=10, max_queued_requests=0)
    w2 = worker_config(config, 2)
    assert (w2.notify_bind, w2.max_concurrent_requests, w2.max_queued_requests) == \
        ("tcp://0.0.0.0:7502", 3, 0)
    auto = msgspec.structs.replace(config, notify_bind="tcp://127.0.0.1:0")
    assert worker_config(auto, 1).notify_bind == "tcp://127.0.0.1:0"
