"""Router overhead: latency and max req/s through the pdgate router vs straight to an engine.

Both paths hit the same minimal fake engines (bench/fake_engine.py). The router is pinned to
core 0; the fake engines and the load generator share the other cores. Figures:

- p50/p99 latency at one connection (sequential keep-alive requests): direct = one call to the
  decode fake; router = a pull-mode completion, i.e. a prefill call plus a decode call.
- max req/s at 32 connections, measured with `wrk` when installed, else an aiohttp client.

    python bench/router_overhead.py [--requests 3000] [--duration 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "pdgate-tiny", "prompt": "The quick brown fox jumps", "max_tokens": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(argv: list[str], cpus: str | None) -> subprocess.Popen[bytes]:
    if cpus and shutil.which("taskset"):
        argv = ["taskset", "-c", cpus, *argv]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=ROOT, start_new_session=True)


def wait_http(port: int, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"port {port}{path} not ready")


def latency_one_conn(port: int, n: int, stream: bool = False) -> tuple[float, float]:
    """p50, p99 in ms of `n` sequential keep-alive POSTs (after a warm-up); with `stream`,
    SSE answers read to the end (a relay without TCP_NODELAY shows up here as ~40 ms)."""
    body = json.dumps({**BODY, "stream": stream}).encode()
    headers = {"Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", port)
    samples: list[float] = []
    for i in range(n + 200):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, headers)
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        if i >= 200:
            samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def throughput_wrk(port: int, conns: int, duration: float) -> float:
    script = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
    script.write(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{json.dumps(BODY)}]]\n"
    )
    script.close()
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{int(duration)}s", "-s", script.name,
         f"http://127.0.0.1:{port}/v1/completions"],
        capture_output=True, text=True, check=True,
    ).stdout
    os.unlink(script.name)
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not m:
        raise RuntimeError(out)
    return float(m.group(1))


async def _throughput_aiohttp(port: int, conns: int, duration: float) -> float:
    import aiohttp

    done = 0
    stop = time.monotonic() + duration
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop:
            async with session.post(url, json=BODY) as resp:
                await resp.read()
                done += resp.status == 200

    connector = aiohttp.TCPConnector(limit=conns)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(conns)))
        return done / (time.monotonic() - t0)


def throughput(port: int, conns: int, duration: float) -> float:
    if shutil.which("wrk"):
        return throughput_wrk(port, conns, duration)
    return asyncio.run(_throughput_aiohttp(port, conns, duration))


def start_router(p_port: int, d_port: int, cpus: str | None,
                 extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    from pdgate.engine_shim.tiny import ensure_tiny_model

    tok = ensure_tiny_model(weights=False)
    port = free_port()
    proc = spawn([sys.executable, "-m", "pdgate.router", "--port", str(port),
                  "--model", "pdgate-tiny",
                  "--tokenizer", str(tok), "--prefill", f"http://127.0.0.1:{p_port}",
                  "--decode", f"http://127.0.0.1:{d_port}", "--log-level", "warning",
                  *(extra or [])], cpus)
    wait_http(port, "/ready")
    return proc, port


def run(args: argparse.Namespace) -> dict[str, float]:
    ncpu = os.cpu_count() or 1
    others = f"1-{ncpu - 1}" if ncpu > 1 else None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        p_port, d_port = free_port(), free_port()
        for port in (p_port, d_port):
            procs.append(spawn([sys.executable, "bench/fake_engine.py", "--port", str(port)],
                               others))
            wait_http(port, "/health")
        router, r_port = start_router(p_port, d_port, "0" if ncpu > 1 else None)
        procs.append(router)
        d50, d99 = latency_one_conn(d_port, args.requests)
        r50, r99 = latency_one_conn(r_port, args.requests)
        ds50, ds99 = latency_one_conn(d_port, args.requests // 2, stream=True)
        rs50, rs99 = latency_one_conn(r_port, args.requests // 2, stream=True)
        d_rps = throughput(d_port, args.connections, args.duration)
        r_rps = throughput(r_port, args.connections, args.duration)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    return {
        "direct_p50_ms": d50, "direct_p99_ms": d99, "router_p50_ms": r50, "router_p99_ms": r99,
        "added_p50_ms": r50 - d50, "added_p99_ms": r99 - d99,
        "direct_stream_p50_ms": ds50, "direct_stream_p99_ms": ds99,
        "router_stream_p50_ms": rs50, "router_stream_p99_ms": rs99,
        "added_stream_p50_ms": rs50 - ds50,
        "direct_rps": d_rps, "router_rps": r_rps, "connections": args.connections,
        "rps_ratio_router_vs_direct": r_rps / d_rps,
        "loadgen_wrk": bool(shutil.which("wrk")),
    }


def print_table(f: dict[str, float]) -> None:
    print("router overhead (pull mode, non-streaming; router pinned to core 0)")
    print(f"{'path':<28}{'p50 ms':>10}{'p99 ms':>10}{'req/s @' + str(f['connections']):>14}")
    print(f"{'direct to engine':<28}{f['direct_p50_ms']:>10.3f}{f['direct_p99_ms']:>10.3f}"
          f"{f['direct_rps']:>14.0f}")
    print(f"{'router (P + D legs)':<28}{f['router_p50_ms']:>10.3f}{f['router_p99_ms']:>10.3f}"
          f"{f['router_rps']:>14.0f}")
    print(f"{'direct, streaming':<28}{f['direct_stream_p50_ms']:>10.3f}"
          f"{f['direct_stream_p99_ms']:>10.3f}{'':>14}")
    print(f"{'router, streaming':<28}{f['router_stream_p50_ms']:>10.3f}"
          f"{f['router_stream_p99_ms']:>10.3f}{'':>14}")
    print(f"added by router: p50 {f['added_p50_ms']:.3f} ms, p99 {f['added_p99_ms']:.3f} ms; "
          f"req/s ratio router/direct {f['rps_ratio_router_vs_direct']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=3000, help="sequential requests per path")
    p.add_argument("--connections", type=int, default=32, help="connections for req/s")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per req/s run")
    p.add_argument("--json", action="store_true", help="print figures as JSON last line")
    args = p.parse_args()
    figures = run(args)
    print_table(figures)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
