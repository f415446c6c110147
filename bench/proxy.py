"""KV-ready proxy: notifications/s, wake latency and memory under a flood nobody claims.

The proxy (a `NotifyServer` in this process, pinned to one core) receives from a sender in a
separate process (pinned to the other cores), over zmq on loopback. Phases:

1. flood: N unclaimed notifications (default 1M) as fast as the sender goes. Throughput is
   N / wall time between first and last frame, and N / proxy CPU seconds over the same window
   (the proxy's capacity on one core, whatever the sender's speed). RSS before, after the
   flood (early arrivals capped at --max-early), after the reaper emptied the table, and after
   gc + malloc_trim (Python's allocator may keep freed memory; we report all three).
2. signed: the same with an HMAC secret, fewer messages.
3. wake latency: W waiters registered and awaiting, notified at a paced rate and then in one
   burst. "wake" is receipt -> waiter resumed (from the wake-latency histogram, interpolated
   inside its buckets); "e2e" is sender's send call -> waiter resumed (exact, same host clock).

    python bench/proxy.py [--flood 1000000] [--waiters 20000] [--rate 20000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This file is itself named proxy.py and its directory leads sys.path: put the repository
# root first so that `import proxy` finds the package.
sys.path.insert(0, str(ROOT))

from proxy import KVReady, NotifySender, NotifyServer, ProxyConfig  # noqa: E402

SECRET = "bench-secret-0123456789"


# ---------------------------------------------------------------- sender (child process)

def run_sender(endpoint: str, count: int, prefix: str, rate: float, secret: str | None) -> None:
    """Send `count` KVReady messages for ids prefix0..; `rate` msgs/s, 0 for as fast as possible.

    A full queue (send returns False) is retried, so every message is delivered.
    """
    with NotifySender(secret=secret, sndhwm=100_000) as sender:
        t0 = time.perf_counter()
        for i in range(count):
            if rate:
                ahead = t0 + i / rate - time.perf_counter()
                if ahead > 0.0002:
                    time.sleep(ahead)
            msg = KVReady(request_id=f"{prefix}{i}", engine_id="bench", num_tokens=128,
                          num_blocks=8)
            while not sender.send(endpoint, msg):
                time.sleep(0.0002)
        # The sockets close with linger 0, dropping what is still queued: stay alive until
        # the bench, having received everything, terminates this process.
        time.sleep(600)


def spawn_sender(endpoint: str, count: int, prefix: str, rate: float = 0.0,
                 secret: str | None = None, cpus: set[int] | None = None,
                 ) -> subprocess.Popen[bytes]:
    argv = [sys.executable, __file__, "--sender", endpoint, str(count), prefix, str(rate)]
    if secret:
        argv.append(secret)
    proc = subprocess.Popen(argv, cwd=ROOT)
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, cpus)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=10)


# ---------------------------------------------------------------- measurements

def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


async def receive(server: NotifyServer, count: int) -> tuple[float, float]:
    """Wait until `count` frames arrived; return (wall s, proxy CPU s) first -> last frame."""
    base = server.frames_received
    while server.frames_received == base:
        await asyncio.sleep(0.001)
    t0, c0 = time.perf_counter(), time.process_time()
    while server.frames_received - base < count:
        await asyncio.sleep(0.005)
    return time.perf_counter() - t0, time.process_time() - c0


async def flood(args: argparse.Namespace, secret: str | None, n: int) -> dict[str, float]:
    cfg = ProxyConfig(bind="tcp://127.0.0.1:0", ttl_s=args.ttl, reap_interval_s=0.25,
                      max_early=args.max_early, notify_secret=secret)
    async with NotifyServer(cfg) as server:
        trim()
        rss0 = rss_mib()
        proc = spawn_sender(server.endpoint, n, "f-", secret=secret, cpus=args.sender_cpus)
        wall, cpu = await receive(server, n)
        rss_flood = rss_mib()
        held = server.waiters.early_count()
        while server.waiters.early_count():
            await asyncio.sleep(0.05)
        rss_reaped = rss_mib()
        trim()
        rss_trimmed = rss_mib()
        stop(proc)
        evicted = server.metrics.registry.get_sample_value(
            "pdgate_proxy_evictions_total", {"reason": "count"}) or 0.0
    return {"n": n, "rate_wall": n / wall, "rate_cpu": n / max(cpu, 1e-9), "cpu_util": cpu / wall,
            "held_after_flood": held, "evicted": evicted, "rss_base_mib": rss0,
            "rss_flood_mib": rss_flood, "rss_reaped_mib": rss_reaped,
            "rss_trimmed_mib": rss_trimmed}


def hist_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Quantile from cumulative (upper bound, count) pairs, linear inside a bucket."""
    total = buckets[-1][1]
    rank, lo, below = q * total, 0.0, 0.0
    for ub, cum in buckets:
        if cum >= rank:
            if ub == float("inf"):
                return lo
            return lo + (ub - lo) * (rank - below) / max(cum - below, 1.0)
        lo, below = ub, cum
    return lo


def exact_quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def wake(n: int, rate: float, tag: str, cpus: set[int]) -> dict[str, float]:
    async with NotifyServer(ProxyConfig(bind="tcp://127.0.0.1:0")) as server:
        e2e: list[float] = []

        async def waiter(rid: str) -> None:
            msg = await server.waiters.wait(rid, timeout=120)
            e2e.append(time.time() - msg.ts)

        rids = [f"{tag}{i}" for i in range(n)]
        for rid in rids:
            server.waiters.register(rid)
        tasks = [asyncio.create_task(waiter(rid)) for rid in rids]
        await asyncio.sleep(0.1)
        proc = spawn_sender(server.endpoint, n, tag, rate=rate, cpus=cpus)
        await asyncio.gather(*tasks)
        stop(proc)
        reg = server.metrics.registry
        buckets = [(float(s.labels["le"]), s.value) for m in reg.collect()
                   if m.name == "pdgate_proxy_wake_latency_seconds" for s in m.samples
                   if s.name.endswith("_bucket")]
    us = 1e6
    return {"wake_p50_us": hist_quantile(buckets, 0.5) * us,
            "wake_p99_us": hist_quantile(buckets, 0.99) * us,
            "e2e_p50_us": exact_quantile(e2e, 0.5) * us,
            "e2e_p99_us": exact_quantile(e2e, 0.99) * us}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"cpus_visible": len(os.sched_getaffinity(0)),
                               "loop": args.loop, "loadavg_1m": os.getloadavg()[0],
                               "pythonmalloc": os.environ.get("PYTHONMALLOC", "default")}
    figures["flood"] = await flood(args, None, args.flood)
    if args.signed:
        figures["signed"] = await flood(args, SECRET, args.signed)
    if args.waiters:
        figures["paced"] = await wake(args.waiters, args.rate, "p-", args.sender_cpus)
        figures["burst"] = await wake(args.waiters, 0.0, "b-", args.sender_cpus)
    return figures


def print_table(f: dict[str, Any]) -> None:
    fl = f["flood"]
    print(f"proxy bench: loop={f['loop']}, PYTHONMALLOC={f['pythonmalloc']}, proxy pinned to "
          f"1 core, load avg {f['loadavg_1m']:.2f}")
    rows = [
        (f"notifications/s, wall ({fl['n']:,} unclaimed)", f"{fl['rate_wall']:,.0f}"),
        ("notifications/s per proxy CPU-second", f"{fl['rate_cpu']:,.0f}"),
        ("proxy CPU utilisation during flood", f"{fl['cpu_util']:.0%}"),
        ("early arrivals held after flood / evicted",
         f"{fl['held_after_flood']:,.0f} / {fl['evicted']:,.0f}"),
        ("RSS MiB: baseline", f"{fl['rss_base_mib']:.1f}"),
        ("RSS MiB: after flood", f"{fl['rss_flood_mib']:.1f}"),
        ("RSS MiB: after reaper", f"{fl['rss_reaped_mib']:.1f}"),
        ("RSS MiB: after reaper + gc + malloc_trim", f"{fl['rss_trimmed_mib']:.1f}"),
    ]
    if sg := f.get("signed"):
        rows += [(f"notifications/s, HMAC on, wall ({sg['n']:,})", f"{sg['rate_wall']:,.0f}"),
                 ("notifications/s, HMAC on, per CPU-second", f"{sg['rate_cpu']:,.0f}")]
    for tag, title in (("paced", f"paced {f['rate']:,.0f}/s"),
                       ("burst", f"burst of {f['waiters']:,}")):
        if ph := f.get(tag):
            rows += [(f"wake p50 / p99 us, {title}",
                      f"{ph['wake_p50_us']:.0f} / {ph['wake_p99_us']:.0f}"),
                     (f"send->resume p50 / p99 us, {title}",
                      f"{ph['e2e_p50_us']:.0f} / {ph['e2e_p99_us']:.0f}")]
    print(f"{'figure':<52}{'value':>16}")
    for name, val in rows:
        print(f"{name:<52}{val:>16}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--sender":
        endpoint, count, prefix, rate = sys.argv[2:6]
        run_sender(endpoint, int(count), prefix, float(rate),
                   sys.argv[6] if len(sys.argv) > 6 else None)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flood", type=int, default=1_000_000, help="unclaimed notifications")
    p.add_argument("--signed", type=int, default=200_000, help="notifications with HMAC on")
    p.add_argument("--waiters", type=int, default=20_000, help="waiters per latency phase")
    p.add_argument("--rate", type=float, default=20_000, help="paced notifications/s")
    p.add_argument("--max-early", type=int, default=100_000, help="early-arrival cap")
    p.add_argument("--ttl", type=float, default=2.0, help="early-arrival TTL (s)")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop",
                   help="event loop (the router runs under uvloop)")
    p.add_argument("--json", action="store_true", help="print figures as JSON last line")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    args.sender_cpus = set(cpus[1:])
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]})
    if args.loop == "uvloop":
        import uvloop
        figures = uvloop.run(run(args))
    else:
        figures = asyncio.run(run(args))
    figures.update(rate=args.rate, waiters=args.waiters)
    print_table(figures)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
