"""`pdgate up --device a,b,...` spreads the engines over devices in start order (one engine
per GPU on a multi-GPU host): each engine process is started with its device, and the
cluster serves. On this CPU machine the devices are `cpu` and `cpu:0` (two names torch
accepts), which is enough to see which process got which."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdgate import up
from tests.e2e.cluster import child_pids, start_cluster

pytestmark = pytest.mark.slow


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _children(cluster_pid: int) -> dict[str, tuple[int, list[str]]]:
    """`pdgate up`'s children by name (an engine's --engine-id, or "router"): pid, argv."""
    found = {}
    for pid in child_pids(cluster_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        name = _flag(argv, "--engine-id") if "pdgate.engine_shim" in argv else \
            "router" if "pdgate.router" in argv else str(pid)
        found[name] = (pid, argv)
    return found


def test_engines_take_the_listed_devices_in_turn(tiny_model_dir: Path, tmp_path: Path) -> None:
    c = start_cluster(tmp_path, tiny_model_dir, prefill=1, decode=2,
                      extra=["--device", "cpu, cpu:0"])
    try:
        devices = {name: _flag(argv, "--device") for name, (_, argv)
                   in _children(c.proc.pid).items() if "pdgate.engine_shim" in argv}
        assert devices == {"prefill-0": "cpu", "decode-0": "cpu:0", "decode-1": "cpu"}
        r = httpx.post(f"{c.router}/v1/completions", timeout=60, json={
            "model": c.model, "prompt": "one device each", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert c.stop() == 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores, one per engine")
def test_cores_per_engine_gives_each_engine_cores_of_its_own(tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    c = start_cluster(tmp_path, tiny_model_dir, prefill=1, decode=1,
                      extra=["--cores-per-engine", "1"])
    try:
        cores = {name: sorted(os.sched_getaffinity(pid))
                 for name, (pid, _) in _children(c.proc.pid).items()}
        assert cores["prefill-0"] == [0] and cores["decode-0"] == [1]
        assert cores["router"] == sorted(os.sched_getaffinity(0))  # not confined
        r = httpx.post(f"{c.router}/v1/completions", timeout=60, json={
            "model": c.model, "prompt": "a core each", "max_tokens": 4})
        assert r.status_code == 200, r.text
    finally:
        assert c.stop() == 0


def test_more_cores_than_the_machine_has_are_refused() -> None:
    done = subprocess.run([sys.executable, "-m", "pdgate.cli", "up", "--cores-per-engine",
                           str((os.cpu_count() or 1) + 1)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--cores-per-engine" in done.stderr and "2 engines" in done.stderr


def test_up_waits_until_the_router_counts_every_engine(tmp_path: Path) -> None:
    """A router is ready with one healthy pair and sees later engines at its next health
    check (seen on a GPU host: engines warming up, two of four healthy for 5 s, while a
    benchmark's burst ran). `pdgate up` waits until the router's /ready counts them all. The
    router here answers /ready as a real one does while it sees 2, then 4 engines."""
    answers = [(1, 1)] * 3 + [(2, 2)]
    asked: list[int] = []

    class Router(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            p, d = answers[min(len(asked), len(answers) - 1)]
            asked.append(p + d)
            body = json.dumps({"status": "ready", "prefill_healthy": p,
                               "decode_healthy": d}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        router = up.Child("router", url, subprocess.Popen(["sleep", "30"]), tmp_path / "log")
        cluster = up.Cluster(tmp_path, [router])
        up._wait_ready(cluster, router, "/ready", time.monotonic() + 30, engines=4)
        assert asked == [2, 2, 2, 4]
        router.proc.kill()
        router.proc.wait()
    finally:
        server.shutdown()


def test_a_device_list_naming_nothing_is_refused() -> None:
    done = subprocess.run([sys.executable, "-m", "pdgate.cli", "up", "--device", " , "],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--device names no device" in done.stderr
