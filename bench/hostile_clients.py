"""Normal clients while hostile ones trickle: does the router keep serving?

Starts the router (pinned to core 0) in front of two fast fake engines, opens `--trickle`
connections that upload a request body one byte every `--gap` seconds and `--slowloris`
connections that send their headers the same way (each reconnects when the router cuts
it), and meanwhile runs `--clients` normal clients sending 200-word completions back to
back. Prints the normal requests' success rate and latency (p50/p99/max) and how many
hostile connections the router cut, side by side with a baseline run without the attack.

    python bench/hostile_clients.py [--trickle 2100] [--slowloris 500] [--duration 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.router_overhead import free_port, spawn, start_router, wait_http  # noqa: E402

WORDS = ("the quick brown fox jumps over the lazy dog while routers move caches " * 20).split()
BODY = json.dumps({"model": "pdgate-tiny", "prompt": " ".join(WORDS[:200]),
                   "max_tokens": 16}).encode()


async def _trickle_forever(port: int, gap: float, headers_too: bool, stop: float,
                           cut: list[int]) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(BODY))
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(gap)
            continue
        data = head + BODY if headers_too else BODY
        if not headers_too:
            writer.write(head)
        try:
            for i in range(len(data)):
                if time.monotonic() >= stop or reader.at_eof():
                    break
                writer.write(data[i:i + 1])
                await writer.drain()
                await asyncio.sleep(gap)
        except OSError:
            pass
        cut[0] += time.monotonic() < stop
        writer.close()


async def _normal(port: int, stop: float, lat: list[float], fails: list[int]) -> None:
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
    while time.monotonic() < stop:
        t0 = time.perf_counter()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)
            status = await asyncio.wait_for(reader.readline(), 30)
            await asyncio.wait_for(reader.read(65536), 30)
            writer.close()
            ok = status.startswith(b"HTTP/1.1 200")
        except (OSError, TimeoutError):
            ok = False
        lat.append(time.perf_counter() - t0)
        fails[0] += not ok


async def _scenario(port: int, args: argparse.Namespace, attack: bool) -> dict[str, float]:
    stop = time.monotonic() + args.duration
    lat: list[float] = []
    fails, cut = [0], [0]
    hostile = []
    if attack:
        hostile = [asyncio.ensure_future(_trickle_forever(port, args.gap, False, stop, cut))
                   for _ in range(args.trickle)]
        hostile += [asyncio.ensure_future(_trickle_forever(port, args.gap, True, stop, cut))
                    for _ in range(args.slowloris)]
        await asyncio.sleep(min(5.0, args.duration / 4))  # let the attack build up
    await asyncio.gather(*(_normal(port, stop, lat, fails) for _ in range(args.clients)))
    for task in hostile:
        task.cancel()
    await asyncio.gather(*hostile, return_exceptions=True)
    lat.sort()
    n = len(lat)
    return {"requests": n, "ok_pct": 100.0 * (n - fails[0]) / max(n, 1),
            "p50_ms": 1000 * lat[n // 2], "p99_ms": 1000 * lat[int(n * 0.99) - 1],
            "max_ms": 1000 * lat[-1], "hostile_cut": cut[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trickle", type=int, default=2100, help="trickling body uploads")
    p.add_argument("--slowloris", type=int, default=500, help="trickling header senders")
    p.add_argument("--clients", type=int, default=8, help="normal clients, back to back")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between trickled bytes")
    p.add_argument("--duration", type=float, default=40.0, help="seconds per scenario")
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ncpu = os.cpu_count() or 1
    others = f"1-{ncpu - 1}" if ncpu > 1 else None
    procs = []
    try:
        ports = [free_port(), free_port()]
        for port in ports:
            procs.append(spawn([sys.executable, "bench/fake_engine.py", "--port", str(port)],
                               others))
            wait_http(port, "/health")
        router, r_port = start_router(ports[0], ports[1], "0" if ncpu > 1 else None,
                                      args.router_arg)
        procs.append(router)
        base = asyncio.run(_scenario(r_port, args, attack=False))
        hit = asyncio.run(_scenario(r_port, args, attack=True))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    print(f"router on core 0; {args.clients} normal clients (200-word prompts); attack: "
          f"{args.trickle} trickled bodies + {args.slowloris} slowloris, 1 byte / {args.gap}s")
    print(f"{'scenario':<12}{'requests':>10}{'ok %':>8}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'max ms':>9}{'cut':>7}")
    for name, f in (("baseline", base), ("attack", hit)):
        print(f"{name:<12}{f['requests']:>10.0f}{f['ok_pct']:>8.2f}{f['p50_ms']:>9.1f}"
              f"{f['p99_ms']:>9.1f}{f['max_ms']:>9.1f}{f['hostile_cut']:>7.0f}")


if __name__ == "__main__":
    main()
