"""Load test: 2,000 concurrent connections against one router pinned to one core.

The router (pinned to core 0) fronts two fake engines (bench/fake_engine.py; a prefill and a
decode); a uvloop/aiohttp load generator keeps `--connections` requests in flight for
`--duration` seconds, each connection sending its next request as soon as the last ended
(a share of them streaming). Two runs: the router's default admission limits, then tight ones
(`--tight-concurrent` / `--tight-queued`) so that admission control must refuse the excess.
Pass criteria: the router never dies, every answer is a 200 or a 429 (with Retry-After), no
connection error; figures: req/s, latency of the 200s, 429 count, router RSS (peak).

    python bench/load.py [--connections 2000] [--duration 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import BODY, free_port, spawn, wait_http  # noqa: E402


@dataclass
class RunResult:
    """What one load run saw (client side) and what the router process used."""

    label: str
    statuses: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    missing_retry_after: int = 0
    seconds: float = 0.0
    rss_peak_mib: float = 0.0
    rss_end_mib: float = 0.0
    router_alive: bool = True

    def figures(self) -> dict[str, object]:
        lat = sorted(self.latencies_ms) or [0.0]
        ok, rejected = self.statuses["200"], self.statuses["429"]
        errors = sum(n for k, n in self.statuses.items() if k not in ("200", "429"))
        return {
            "run": self.label, "ok": ok, "rejected_429": rejected, "errors": errors,
            "error_kinds": {k: n for k, n in self.statuses.items() if k not in ("200", "429")},
            "missing_retry_after": self.missing_retry_after,
            "ok_rps": ok / self.seconds if self.seconds else 0.0,
            "p50_ms": statistics.median(lat), "p99_ms": lat[max(0, int(len(lat) * 0.99) - 1)],
            "rss_peak_mib": self.rss_peak_mib, "rss_end_mib": self.rss_end_mib,
            "router_alive": self.router_alive,
        }


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    """A /proc/<pid>/status memory figure (VmRSS now, VmHWM peak) in MiB; 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def _worker(session: object, url: str, start_in: float, stop: float,
                  stream_share: float, res: RunResult) -> None:
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    await asyncio.sleep(start_in)  # a ramp: 2,000 SYNs in one instant only measure the kernel
    while time.monotonic() < stop:
        body = {**BODY, "stream": random.random() < stream_share}
        t0 = time.perf_counter()
        try:
            async with session.post(url, json=body) as resp:
                await resp.read()
                status = resp.status
                if status == 429 and "Retry-After" not in resp.headers:
                    res.missing_retry_after += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            res.statuses[type(exc).__name__] += 1
            continue
        res.statuses[str(status)] += 1
        if status == 200:
            res.latencies_ms.append((time.perf_counter() - t0) * 1000)
        elif status == 429:
            await asyncio.sleep(0.05)  # a polite client; a real one would honour Retry-After


async def _load(port: int, pid: int, args: argparse.Namespace, res: RunResult) -> None:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    conns = args.connections
    connector = aiohttp.TCPConnector(limit=conns, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        stop = t0 + args.ramp_s + args.duration
        workers = [asyncio.create_task(_worker(
            session, url, args.ramp_s * i / conns, stop, args.stream_share, res))
            for i in range(conns)]
        while not all(w.done() for w in workers):
            res.rss_peak_mib = max(res.rss_peak_mib, rss_mib(pid))
            await asyncio.sleep(0.25)
        await asyncio.gather(*workers)
        res.seconds = time.monotonic() - t0


def one_run(label: str, engines: tuple[int, int], router_flags: list[str],
            args: argparse.Namespace) -> RunResult:
    from pdgate.engine_shim.tiny import ensure_tiny_model

    tok = ensure_tiny_model(weights=False)
    port = free_port()
    router = spawn([sys.executable, "-m", "pdgate.router", "--port", str(port), "--model",
                    "pdgate-tiny", "--tokenizer", str(tok), "--prefill",
                    f"http://127.0.0.1:{engines[0]}", "--decode",
                    f"http://127.0.0.1:{engines[1]}", "--log-level", "error", *router_flags],
                   "0" if (os.cpu_count() or 1) > 1 else None)
    res = RunResult(label)
    try:
        wait_http(port, "/ready")
        import uvloop

        uvloop.run(_load(port, router.pid, args, res))
        res.router_alive = router.poll() is None
        res.rss_end_mib = rss_mib(router.pid)
        res.rss_peak_mib = max(res.rss_peak_mib, rss_mib(router.pid, "VmHWM"))
    finally:
        router.terminate()
        router.wait()
    return res


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    ncpu = os.cpu_count() or 1
    others = f"1-{ncpu - 1}" if ncpu > 1 else None
    fakes = []
    try:
        ports = free_port(), free_port()
        for p in ports:
            fakes.append(spawn([sys.executable, "bench/fake_engine.py", "--port", str(p)],
                               others))
            wait_http(p, "/health")
        tight = ["--max-concurrent-requests", str(args.tight_concurrent),
                 "--max-queued-requests", str(args.tight_queued), "--queue-timeout-s", "2"]
        return [one_run("default limits", ports, [], args).figures(),
                one_run(f"tight limits ({args.tight_concurrent}+{args.tight_queued} queued)",
                        ports, tight, args).figures()]
    finally:
        for proc in fakes:
            proc.terminate()
            proc.wait()


def print_table(runs: list[dict[str, object]], args: argparse.Namespace) -> None:
    print(f"load: {args.connections} concurrent connections (opened over {args.ramp_s:g} s) "
          f"for {args.duration:g} s, "
          f"{args.stream_share:.0%} streaming; router pinned to core 0, fake engines")
    head = f"{'run':<34}{'200':>8}{'429':>8}{'errors':>8}{'200/s':>9}{'p50 ms':>9}"
    print(head + f"{'p99 ms':>9}{'RSS peak MiB':>14}{'alive':>7}")
    for r in runs:
        print(f"{r['run']!s:<34}{r['ok']:>8}{r['rejected_429']:>8}{r['errors']:>8}"
              f"{r['ok_rps']:>9.0f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}"
              f"{r['rss_peak_mib']:>14.1f}{r['router_alive']!s:>7}")
        if r["error_kinds"]:
            print(f"  errors: {r['error_kinds']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=2000, help="concurrent connections")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    p.add_argument("--ramp-s", type=float, default=1.0,
                   help="seconds over which the connections open")
    p.add_argument("--stream-share", type=float, default=0.2, help="share of SSE requests")
    p.add_argument("--tight-concurrent", type=int, default=64,
                   help="--max-concurrent-requests of the tight run")
    p.add_argument("--tight-queued", type=int, default=64,
                   help="--max-queued-requests of the tight run")
    p.add_argument("--json", action="store_true", help="print figures as JSON last line")
    args = p.parse_args()
    runs = run(args)
    print_table(runs, args)
    if args.json:
        print(json.dumps({"connections": args.connections, "duration_s": args.duration,
                          "runs": runs}))
    ok = all(r["router_alive"] and r["errors"] == 0 and r["missing_retry_after"] == 0
             for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
