"""Starts a real local cluster with `pdgate up` (shim engines + router) for end-to-end tests."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ports_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def device_args() -> list[str]:
    """`PDGATE_TEST_DEVICE=cuda` runs the same end-to-end tests with CUDA engines (VRAM KV);
    `PDGATE_TEST_DECODE_DEVICE=cuda:1` puts the decode engines on another GPU."""
    device = os.environ.get("PDGATE_TEST_DEVICE")
    args = ["--device", device] if device else []
    if decode_device := os.environ.get("PDGATE_TEST_DECODE_DEVICE"):
        args.append(f"--decode-engine-arg=--device={decode_device}")
    return args


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive free ports (the cluster numbers its engines)."""
    for _ in range(200):
        # Below Linux's ephemeral range (32768+): a port there can be taken by any outgoing
        # connection, or connect to itself before the engine listens.
        base = random.randrange(20000, 32000)
        if _ports_free(base, count):
            return base
    raise RuntimeError("no free port range")


def child_pids(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (from /proc; no psutil needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Cluster:
    """One running `pdgate up` and the URLs of its parts."""

    proc: subprocess.Popen[str]
    router: str
    prefill: list[str]
    decode: list[str]
    log_dir: Path
    model: str = "pdgate-tiny"
    console: str = ""
    # `--models N`: each model's (prefill URLs, decode URLs), model 0 first.
    per_model: list[tuple[list[str], list[str]]] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.log_dir.glob("*.log")))


def start_cluster(tmp: Path, model_dir: Path, *, prefill: int = 1, decode: int = 1,
                  block_size: int = 4, demo: bool = False, extra: list[str] | None = None,
                  timeout: float = 180.0, engine_key: bool = False, models: int = 1,
                  colocated_models: int = 0) -> Cluster:
    """`pdgate up` with `prefill` + `decode` engines per model (`models` of them, the last
    `colocated_models` with decode engines only), ready to serve."""
    counts = [(0 if m >= models - colocated_models else prefill, decode)
              for m in range(models)]
    n = sum(p + d for p, d in counts)
    base = free_port_range(2 * n + 1)
    router_port, engine_base, side_base = base, base + 1, base + 1 + n
    log_dir = tmp / "logs"
    argv = [sys.executable, "-m", "pdgate.cli", "up", "--model", str(model_dir),
            "--prefill", str(prefill), "--decode", str(decode), "--port", str(router_port),
            "--engine-port-base", str(engine_base), "--side-channel-port-base", str(side_base),
            "--block-size", str(block_size), "--num-blocks", "256", "--log-dir", str(log_dir),
            "--kv-digests", *device_args(),
            *(extra or [])]
    if models > 1 or colocated_models:
        argv += ["--models", str(models), "--colocated-models", str(colocated_models)]
    if not demo:
        argv.append("--no-demo")
    if not engine_key:  # the tests call engines directly; `pdgate up` keys them by default
        argv.append("--allow-unauthenticated")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    urls = [f"http://127.0.0.1:{engine_base + i}" for i in range(n)]
    per_model, at = [], 0
    for p, d in counts:
        per_model.append((urls[at:at + p], urls[at + p:at + p + d]))
        at += p + d
    cluster = Cluster(proc, f"http://127.0.0.1:{router_port}",
                      [u for ps, _ in per_model for u in ps],
                      [u for _, ds in per_model for u in ds], log_dir, model=model_dir.name,
                      per_model=per_model)
    _wait_ready(cluster, timeout)
    if demo:
        _wait_for_console(cluster, "Ctrl-C stops the cluster")
    return cluster


def _wait_for_console(cluster: Cluster, marker: str) -> None:
    # `pdgate up` prints the marker after its sample request; a pytest timeout bounds this.
    assert cluster.proc.stdout is not None
    for line in cluster.proc.stdout:
        cluster.console += line
        if marker in line:
            return
    raise RuntimeError(f"pdgate up ended before {marker!r}:\n{cluster.console}")


def _wait_ready(cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.proc.poll() is not None:
            out = cluster.proc.stdout.read() if cluster.proc.stdout else ""
            raise RuntimeError(f"pdgate up exited early:\n{out}\n{cluster.logs()}")
        try:
            if httpx.get(cluster.router + "/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    cluster.stop()
    raise RuntimeError(f"cluster not ready in {timeout}s\n{cluster.logs()}")


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample (optionally filtered by a label substring) at `url`."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not labels or labels in line):
            head = line.split(" ", 1)[0]
            if head.split("{", 1)[0] == name:
                total += float(line.rsplit(" ", 1)[1])
    return total


async def burst(c: Cluster, prompts: list[str], *, full: int, abandoned: int,
                first_max_tokens: int, extra: dict[str, object] | None = None) -> None:
    """`full` complete requests plus `abandoned` streams the client walks away from after
    the first event, all at once through the router."""
    async with httpx.AsyncClient(base_url=c.router, timeout=120) as client:
        async def complete(i: int) -> None:
            r = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": prompts[i % len(prompts)],
                "max_tokens": first_max_tokens + i, **(extra or {})})
            assert r.status_code == 200, r.text

        async def walk_away(i: int) -> None:
            body = {"model": "tiny", "prompt": prompts[i % len(prompts)], "max_tokens": 200,
                    "stream": True, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # the client walks away mid-stream

        await asyncio.gather(*(complete(i) for i in range(full)),
                             *(walk_away(i) for i in range(abandoned)))


def complete(url: str, prompt: str, max_tokens: int = 24,
             headers: dict[str, str] | None = None, **extra: object) -> dict[str, Any]:
    """A greedy, EOS-ignoring completion from `url` (router or engine); asserts a 200."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120.0)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def completion_text(resp: httpx.Response, stream: bool) -> str:
    """The text of a 200 completion answer, streamed (its chunks joined) or not."""
    assert resp.status_code == 200, resp.text
    if not stream:
        return str(resp.json()["choices"][0]["text"])
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    return "".join(c["text"] for e in events for c in e["choices"])


def pool_states(c: Cluster) -> list[tuple[float, float, float]]:
    """(free, total, leased) KV blocks of every engine, from their metrics."""
    return [(metric(u, "pdgate_shim_kv_blocks_free"), metric(u, "pdgate_shim_kv_blocks_capacity"),
             metric(u, "pdgate_shim_kv_blocks_leased")) for u in c.prefill + c.decode]


def wait_pools_full(c: Cluster, timeout: float = 30.0) -> None:
    """Every engine's block pool back to fully free with nothing leased, or the test fails."""
    deadline = time.monotonic() + timeout
    states: list[tuple[float, float, float]] = []
    while time.monotonic() < deadline:
        states = pool_states(c)
        if all(free == total and leased == 0 for free, total, leased in states):
            return
        time.sleep(0.5)
    pytest.fail(f"block pools not back to full: {states}\n{c.logs()}")
