"""Priority and fairness in the router's admission queue: a flooding key beside an
interactive key, FIFO against the fair queue, with and without a reserved slot, in one run
(CPU, shim engines).

For each admission setup (`fifo`; `fair`; `reserved`: fair with `--reserved-slots`,
default 1, slots only a key with nothing in service may take) a fresh 1P1D `pdgate up`
cluster is started with
two client keys (`flood` and `interactive`, `--interactive-priority`, default 0: the same
priority, so only the keys tell them apart) and a small admission limit
(`--max-concurrent`, default 2), so that the flood queues in the router, where the order
is decided. Then:

1. alone: the interactive key sends `--interactive` streaming requests one at a time;
2. beside the flood: `--flood-concurrency` flood workers keep the queue full, and the
   interactive key sends the same requests one at a time again.

TTFT is client send -> first content chunk (admission wait included); latency is send ->
[DONE]. The table gives the interactive key's p50/p99 alone and beside the flood per order,
the ratio of its p99 beside the flood to its p99 alone, and the flood's own throughput.
The issue's goal: the interactive p99 within 20 % of its alone figure (ratio <= 1.2).

    python bench/priority.py [--interactive 40] [--flood-concurrency 16] [--json]

Every process shares the machine's cores: compare figures from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.e2e import _free_base, launch, one, prompt, stop  # noqa: E402

ORDERS = ("fifo", "fair", "reserved")
FLOOD_KEY = "sk-bench-flood-key"
INTERACTIVE_KEY = "sk-bench-interactive-key"


def start(order: str, args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen[bytes],
                                                                   str]:
    """A 1P1D `pdgate up` whose router admits in `order`; the process and router URL."""
    base = _free_base(5)
    keys = json.dumps([
        {"key": FLOOD_KEY, "name": "flood", "priority": 0},
        {"key": INTERACTIVE_KEY, "name": "interactive", "priority": args.interactive_priority},
    ])
    argv = [sys.executable, "-m", "pdgate.cli", "up", "--no-demo", "--port", str(base),
            "--engine-port-base", str(base + 1), "--side-channel-port-base", str(base + 3),
            "--block-size", "16", "--num-blocks", "2048", "--log-dir", str(tmp / order),
            f"--router-arg=--admission-order={'fifo' if order == 'fifo' else 'fair'}",
            f"--router-arg=--reserved-slots={args.reserved_slots * (order == 'reserved')}",
            f"--router-arg=--max-concurrent-requests={args.max_concurrent}",
            "--router-arg=--max-queued-requests=4096", "--router-arg=--queue-timeout-s=300",
            f"--router-arg=--client-keys={keys}", *args.up_arg]
    return launch(argv, base, order, tmp / order, 180.0)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def interactive(url: str, args: argparse.Namespace,
                      offset: int) -> list[tuple[float, float, float]]:
    """`args.interactive` requests one at a time: (TTFT, latency, longest gap) seconds each."""
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 headers=_auth(INTERACTIVE_KEY)) as client:
        return [await one(client, prompt(offset + i, args.prompt_tokens), args.max_tokens)
                for i in range(args.interactive)]


async def beside_flood(url: str, args: argparse.Namespace,
                       offset: int) -> tuple[list[tuple[float, float, float]], float]:
    """The interactive requests while the flood runs: theirs, and the flood's req/s."""
    stop_flood = asyncio.Event()
    done = 0
    limits = httpx.Limits(max_connections=args.flood_concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits,
                                 headers=_auth(FLOOD_KEY)) as client:
        async def flood_worker(w: int) -> None:
            nonlocal done
            i = 0
            while not stop_flood.is_set():
                await one(client, prompt(500_000 + 1000 * w + i, args.prompt_tokens),
                          args.flood_max_tokens)
                done += 1
                i += 1

        workers = [asyncio.create_task(flood_worker(w)) for w in range(args.flood_concurrency)]
        await asyncio.sleep(args.flood_lead_s)  # the flood fills the queue first
        t0 = time.perf_counter()
        got = await interactive(url, args, offset)
        wall = time.perf_counter() - t0
        counted = done
        stop_flood.set()
        await asyncio.gather(*workers)
    return got, counted / wall


def summary(results: list[tuple[float, float, float]]) -> dict[str, float]:
    ttfts = sorted(r[0] for r in results)
    lats = sorted(r[1] for r in results)
    gaps = sorted(r[2] for r in results)
    p99 = min(len(results) - 1, round(0.99 * (len(results) - 1)))
    return {"ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p99_ms": 1000 * ttfts[p99],
            "latency_p50_ms": 1000 * statistics.median(lats),
            "latency_p99_ms": 1000 * lats[p99],
            # each request's longest wait between two tokens: a tail made of one stall
            # shows here, one made of slower steps does not
            "max_gap_p50_ms": 1000 * statistics.median(gaps), "max_gap_p99_ms": 1000 * gaps[p99]}


def run_order(order: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    proc, url = start(order, args, tmp)
    try:
        asyncio.run(interactive(url, argparse.Namespace(**{**vars(args), "interactive": 4}),
                                900_000))  # warm-up
        alone = summary(asyncio.run(interactive(url, args, 0)))
        got, flood_rps = asyncio.run(beside_flood(url, args, 0))
        flooded = summary(got)
    finally:
        stop(proc)
    return {"alone": alone, "beside_flood": flooded, "flood_req_per_s": flood_rps,
            "p99_ratio": {k: flooded[k] / alone[k] for k in ("ttft_p99_ms",
                                                             "latency_p99_ms")}}


def table(figures: dict[str, Any]) -> str:
    rows = ["| order | interactive | TTFT p50 ms | TTFT p99 ms | latency p50 ms | "
            "latency p99 ms | longest gap p99 ms | flood req/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for order, f in figures.items():
        for phase in ("alone", "beside_flood"):
            s = f[phase]
            rps = f"{f['flood_req_per_s']:.1f}" if phase == "beside_flood" else "-"
            rows.append(f"| {order} | {phase.replace('_', ' ')} | {s['ttft_p50_ms']:.0f} | "
                        f"{s['ttft_p99_ms']:.0f} | {s['latency_p50_ms']:.0f} | "
                        f"{s['latency_p99_ms']:.0f} | {s['max_gap_p99_ms']:.0f} | {rps} |")
    rows.append("")
    for order, f in figures.items():
        r = f["p99_ratio"]
        met = "met" if r["latency_p99_ms"] <= 1.2 else "not met"
        rows.append(f"{order}: interactive p99 beside the flood / alone: TTFT "
                    f"{r['ttft_p99_ms']:.2f}x, latency {r['latency_p99_ms']:.2f}x "
                    f"(goal <= 1.2x: {met})")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interactive", type=int, default=40,
                   help="interactive requests per phase, one at a time (default 40)")
    p.add_argument("--flood-concurrency", type=int, default=16,
                   help="flood workers, each one request at a time (default 16)")
    p.add_argument("--flood-lead-s", type=float, default=1.0,
                   help="seconds the flood runs before the interactive phase (default 1)")
    p.add_argument("--max-concurrent", type=int, default=2,
                   help="the router's --max-concurrent-requests (default 2)")
    p.add_argument("--reserved-slots", type=int, default=1,
                   help="the `reserved` setup's --reserved-slots (default 1)")
    p.add_argument("--interactive-priority", type=int, default=0,
                   help="the interactive key's priority (the flood's is 0; default 0)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="tokens per interactive request (default 16)")
    p.add_argument("--flood-max-tokens", type=int, default=16,
                   help="tokens per flood request (default 16)")
    p.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                   help="extra `pdgate up` flag (repeatable), e.g. "
                        "--up-arg=--prefill-engine-arg=--cpus=0")
    p.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    p.add_argument("--keep-logs", default=None, metavar="DIR",
                   help="copy each cluster's logs (JSON lines) into DIR")
    args = p.parse_args()
    if args.keep_logs:
        args.up_arg = [*args.up_arg, "--log-format=json"]
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-priority-") as tmp:
        for order in args.orders:
            figures[order] = run_order(order, args, Path(tmp))
            print(f"  {order:<5} done", file=sys.stderr, flush=True)
            if args.keep_logs:
                shutil.copytree(Path(tmp) / order, Path(args.keep_logs) / order,
                                ignore=shutil.ignore_patterns("engine-api-key"),
                                dirs_exist_ok=True)
    print(table(figures))
    if args.json:
        print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
