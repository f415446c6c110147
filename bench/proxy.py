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

``--junk-flood N`` runs only the junk-flood phase instead: the proxy (HMAC on) has R real
waiters registered with tokens (default 1,032, each waiting up to 30 s) while one sender
process floods N junk messages over --junk-sockets connections and another sends the R real,
signed, tokened notices at --real-rate. Junk kinds (--junk-kind, default mixed: all in turn):
garbage bytes, badmac (a notice with a wrong MAC), forged (a validly signed `failed` notice
for a real request without its token: what a prefill engine signs for anyone who can send it
a prefill), bomb (a signed 5,000-deep nested JSON payload), big (60 KB with a wrong MAC).
Printed: real notices delivered (status ok within the wait) and how many of them arrived
while junk was still coming in, send -> waiter resumed p50/p99, junk messages/s handled by
the proxy, the event loop's lag (a 1 ms ticker on the proxy's loop: what the router's HTTP
handling would feel) and RSS. Runs against older proxies too (no tokens there), to compare.

    python bench/proxy.py --junk-flood 1000000 [--junk-kind mixed] [--junk-sockets 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import hashlib
import json
import os
import secrets
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

import msgspec  # noqa: E402
import zmq  # noqa: E402

from pdgate.proxy import KVReady, NotifySender, NotifyServer, ProxyConfig, ProxyError  # noqa: E402
from pdgate.proxy.wire import PROTOCOL_VERSION, sign  # noqa: E402

SECRET = "bench-secret-0123456789"
# Proxies from before wire v2 have no tokens: the junk-flood phase then runs without them.
TOKENS = "token" in KVReady.__struct_fields__
JUNK_KINDS = ("garbage", "badmac", "forged", "bomb", "big")


def token_for(seed: str, rid: str) -> str:
    """The notify token of `rid` (both processes derive it, as the router would send it)."""
    return hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest()[:32] if seed else ""


# ---------------------------------------------------------------- sender (child process)

def run_sender(endpoint: str, count: int, prefix: str, rate: float, secret: str | None,
               token_seed: str = "") -> None:
    """Send `count` KVReady messages for ids prefix0..; `rate` msgs/s, 0 for as fast as possible.

    A full queue (send returns False) is retried, so every message is delivered.
    """
    extra = {}
    with NotifySender(secret=secret, sndhwm=100_000) as sender:
        t0 = time.perf_counter()
        for i in range(count):
            if rate:
                ahead = t0 + i / rate - time.perf_counter()
                if ahead > 0.0002:
                    time.sleep(ahead)
            rid = f"{prefix}{i}"
            if token_seed:
                extra = {"token": token_for(token_seed, rid)}
            msg = KVReady(request_id=rid, engine_id="bench", num_tokens=128, num_blocks=8,
                          **extra)
            while not sender.send(endpoint, msg):
                time.sleep(0.0002)
        # The sockets close with linger 0, dropping what is still queued: stay alive until
        # the bench, having received everything, terminates this process.
        time.sleep(600)


def spawn_sender(endpoint: str, count: int, prefix: str, rate: float = 0.0,
                 secret: str | None = None, cpus: set[int] | None = None,
                 token_seed: str = "") -> subprocess.Popen[bytes]:
    argv = [sys.executable, __file__, "--sender", endpoint, str(count), prefix, str(rate),
            secret or "", token_seed]
    proc = subprocess.Popen(argv, cwd=ROOT)
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, cpus)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def junk_messages(kind: str, n_rids: int) -> list[list[bytes]]:
    """One cycle of junk messages of `kind` ("mixed": every kind in turn); the notices name
    every real request in turn."""
    if kind == "mixed":
        per_kind = [junk_messages(k, n_rids) for k in JUNK_KINDS]
        return [m for group in zip(*per_kind, strict=True) for m in group]
    key = SECRET.encode()
    bomb = b'{"v": 2, "kind": "kv_ready", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    fixed = {"bomb": [bomb, sign(bomb, key)], "big": [b"x" * 60_000, b"\x00" * 32]}
    out: list[list[bytes]] = []
    for i in range(max(n_rids, 64)):
        if kind in fixed:
            out.append(fixed[kind])  # the same objects: a cycle of these costs no memory
            continue
        # Built as a map so older proxies (no token field) read it as a plain failed notice.
        forged = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "kind": "kv_ready",
                                         "request_id": f"real-{i % max(n_rids, 1)}",
                                         "status": "failed", "error": "forged",
                                         "token": "not-the-token"})
        out.append({"garbage": [b"\x00\xffjunk-%d" % i], "badmac": [forged, b"\x00" * 32],
                    "forged": [forged, sign(forged, key)]}[kind])
    return out


def run_junk_sender(endpoint: str, count: int, kind: str, n_sockets: int, n_rids: int) -> None:
    """Send `count` junk messages as fast as zmq takes them, round robin over `n_sockets`."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = []
    for _ in range(n_sockets):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    cycle = junk_messages(kind, n_rids)
    for i in range(count):
        socks[i % n_sockets].send_multipart(cycle[i % len(cycle)])  # blocks while full
    time.sleep(600)  # linger 0: stay until the bench has received everything


def spawn_junk(endpoint: str, count: int, kind: str, n_sockets: int, n_rids: int,
               cpus: set[int]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, __file__, "--junk-sender", endpoint, str(count), kind,
            str(n_sockets), str(n_rids)]
    proc = subprocess.Popen(argv, cwd=ROOT)
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, cpus)
    return proc


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


class LoopLag:
    """A 1 ms ticker on the proxy's event loop: how late each tick fires is the delay any
    other task on that loop (the router's HTTP handling) would see."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.rss_peak = rss_mib()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        n = 0
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)
            n += 1
            if n % 100 == 0:
                self.rss_peak = max(self.rss_peak, rss_mib())

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def until_quiet(server: NotifyServer, total: int, quiet_s: float = 15.0) -> float:
    """Wait until `total` frames arrived, or none arrived for `quiet_s`; return the time of
    the last frame (perf_counter)."""
    last, seen = time.perf_counter(), server.frames_received
    while server.frames_received < total:
        await asyncio.sleep(0.01)
        if server.frames_received != seen:
            last, seen = time.perf_counter(), server.frames_received
        elif time.perf_counter() - last > quiet_s:
            break
    return last


async def junk_flood(args: argparse.Namespace) -> dict[str, Any]:
    server = NotifyServer(ProxyConfig(bind="tcp://127.0.0.1:0", notify_secret=SECRET))
    await server.start()
    try:
        figures = await _junk_flood(server, args)
    finally:
        try:
            await server.close()
            died = ""
        except Exception as exc:  # an old proxy's receive loop can die of its input
            died = f"{type(exc).__name__}: {exc}"
    return {**figures, "loop_died": died}


async def _junk_flood(server: NotifyServer, args: argparse.Namespace) -> dict[str, Any]:
    n_real, n_junk = args.real, args.junk_flood
    seed = secrets.token_hex(8) if TOKENS else ""
    rids = [f"real-{i}" for i in range(n_real)]
    for rid in rids:
        if TOKENS:
            server.waiters.register(rid, token=token_for(seed, rid))
        else:
            server.waiters.register(rid)
    e2e: dict[str, float] = {}
    delivered_at: dict[str, float] = {}
    outcomes: dict[str, int] = {}

    async def waiter(rid: str) -> None:
        try:
            msg = await server.waiters.wait(rid, timeout=args.wait_timeout)
        except ProxyError as exc:
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
            return
        e2e[rid] = time.time() - msg.ts
        delivered_at[rid] = time.perf_counter()
        outcomes["ok"] = outcomes.get("ok", 0) + 1

    tasks = [asyncio.create_task(waiter(rid)) for rid in rids]
    lag = LoopLag()
    junk = spawn_junk(server.endpoint, n_junk, args.junk_kind, args.junk_sockets, n_real,
                      args.sender_cpus)
    start = time.perf_counter()  # let the flood get going (an old proxy may stop early)
    while server.frames_received < 1000 and time.perf_counter() - start < 2:
        await asyncio.sleep(0.001)
    t0, c0 = time.perf_counter(), time.process_time()
    real = spawn_sender(server.endpoint, n_real, "real-", rate=args.real_rate,
                        secret=SECRET, cpus=args.sender_cpus, token_seed=seed)
    await asyncio.gather(*tasks)
    t_last = await until_quiet(server, n_junk + n_real)
    cpu = time.process_time() - c0
    frames = server.frames_received
    await lag.stop()
    stop(real)
    stop(junk)
    during = sum(1 for t in delivered_at.values() if t <= t_last)
    lat = sorted(e2e.values())
    wall = max(t_last - t0, 1e-9)
    return {
        "kind": args.junk_kind, "sockets": args.junk_sockets, "n_junk": n_junk,
        "n_real": n_real, "tokens": TOKENS, "delivered": len(e2e),
        "delivered_pct": 100.0 * len(e2e) / n_real, "delivered_during_flood": during,
        "outcomes": outcomes, "frames_received": frames,
        "junk_per_s": (frames - n_real) / wall if frames >= n_junk else float("nan"),
        "frames_per_cpu_s": frames / max(cpu, 1e-9),
        "e2e_p50_ms": exact_quantile(lat, 0.5) * 1e3 if lat else float("nan"),
        "e2e_p99_ms": exact_quantile(lat, 0.99) * 1e3 if lat else float("nan"),
        "lag_p50_ms": exact_quantile(lag.lags, 0.5) * 1e3,
        "lag_p99_ms": exact_quantile(lag.lags, 0.99) * 1e3,
        "lag_max_ms": max(lag.lags) * 1e3, "rss_peak_mib": lag.rss_peak,
    }


def print_junk(f: dict[str, Any]) -> None:
    j = f["junk"]
    print(f"proxy junk flood: loop={f['loop']}, proxy pinned to 1 core, HMAC on, tokens "
          f"{'on' if j['tokens'] else 'off (pre-v2 proxy)'}, load avg {f['loadavg_1m']:.2f}")
    stalled = "" if j["frames_received"] >= j["n_junk"] else \
        f" (loop stopped after {j['frames_received']:,})"
    rows = [
        ("junk", f"{j['n_junk']:,} {j['kind']} over {j['sockets']} connection(s)"),
        ("real notices delivered (ok within the wait)",
         f"{j['delivered']:,} / {j['n_real']:,} ({j['delivered_pct']:.1f} %)"),
        ("  of which while junk was still arriving", f"{j['delivered_during_flood']:,}"),
        ("wait outcomes", ", ".join(f"{k} {v}" for k, v in sorted(j["outcomes"].items()))),
        ("send -> waiter resumed p50 / p99 ms",
         f"{j['e2e_p50_ms']:.1f} / {j['e2e_p99_ms']:.1f}"),
        ("junk messages/s handled" + stalled, f"{j['junk_per_s']:,.0f}"),
        ("messages per proxy CPU-second", f"{j['frames_per_cpu_s']:,.0f}"),
        ("event-loop lag p50 / p99 / max ms",
         f"{j['lag_p50_ms']:.2f} / {j['lag_p99_ms']:.2f} / {j['lag_max_ms']:.1f}"),
        ("RSS peak MiB", f"{j['rss_peak_mib']:.1f}"),
    ]
    if j["loop_died"]:
        rows.append(("receive loop died of", j["loop_died"][:40]))
    for name, val in rows:
        print(f"{name:<46}{val:>40}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"cpus_visible": len(os.sched_getaffinity(0)),
                               "loop": args.loop, "loadavg_1m": os.getloadavg()[0],
                               "pythonmalloc": os.environ.get("PYTHONMALLOC", "default")}
    if args.junk_flood:
        figures["junk"] = await junk_flood(args)
        return figures
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
        endpoint, count, prefix, rate, secret, seed = sys.argv[2:8]
        run_sender(endpoint, int(count), prefix, float(rate), secret or None, seed)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--junk-sender":
        endpoint, count, kind, sockets, rids = sys.argv[2:7]
        run_junk_sender(endpoint, int(count), kind, int(sockets), int(rids))
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
    p.add_argument("--junk-flood", type=int, default=0,
                   help="run only the junk-flood phase with this many junk messages")
    p.add_argument("--junk-kind", choices=[*JUNK_KINDS, "mixed"], default="mixed",
                   help="junk sent by the flooder (mixed: every kind in turn)")
    p.add_argument("--junk-sockets", type=int, default=1, help="flooder's connections")
    p.add_argument("--real", type=int, default=1032, help="real notices during the flood")
    p.add_argument("--real-rate", type=float, default=200, help="real notices/s")
    p.add_argument("--wait-timeout", type=float, default=30, help="each real wait (s)")
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
    if "junk" in figures:
        print_junk(figures)
    else:
        print_table(figures)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
