"""Routing quality: prefix-cache hit rate, load balance and TTFT per prefill policy.

Setup (one process, all on loopback): the real router app (uvicorn) in front of 2 prefill +
2 decode FAKE engines. The fakes simulate what matters for routing and nothing else:

- a prefix cache of `--cache-blocks` blocks per engine (LRU over chained block hashes, the
  shim's `engine_shim.prefix_cache.block_hashes`), reporting hits per request;
- prefill compute time `--us-per-token` x uncached prompt tokens, one prefill at a time per
  engine (so a hot engine queues and TTFT shows imbalance);
- KV cache events in vLLM's format on a ZMQ PUB socket (the shim's publisher), so the
  `kv-events` policy sees their caches exactly.

Workload (token-id prompts, shuffled, `--concurrency` clients): 32 system prompts x 8 users x
3 turns, each request = its system prompt (16 blocks) + a unique 2-block user part, plus 25%
unique prompts. The oracle hit rate counts, for every request, the system prompt's tokens as
cached whenever that system prompt was seen before (an ideal router with enough cache).

    python bench/routing.py [--requests 1024] [--json]

The last line with `--json` is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import uvicorn  # noqa: E402
from aiohttp import web  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from pdgate.engine_shim.kv_events import KVEventPublisher  # noqa: E402
from pdgate.engine_shim.metrics import ShimMetrics  # noqa: E402
from pdgate.engine_shim.prefix_cache import (  # noqa: E402
    BlockRemovedEvent,
    BlockStoredEvent,
    CacheEvent,
    block_hashes,
)
from pdgate.engine_shim.tiny import ensure_tiny_model  # noqa: E402
from pdgate.router.config import RouterConfig  # noqa: E402
from pdgate.router.http.app import create_app  # noqa: E402
from pdgate.router.input.tokenization import load_tokenizer  # noqa: E402

BS = 16
POLICIES = ["round-robin", "least-inflight", "power-of-two", "session", "prefix-aware",
            "kv-events"]


@dataclass
class CacheEngine:
    """A fake engine with a simulated prefix cache (see the module docstring)."""

    name: str
    capacity: int
    us_per_token: float
    publisher: KVEventPublisher | None = None
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids: list[int] = body["prompt"]
        prefill = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
        if prefill:
            await self._prefill(ids)
        reply: dict[str, Any] = {
            "id": "cmpl-x", "object": "text_completion", "created": 0, "model": "bench",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                         "logprobs": None}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1,
                      "total_tokens": len(ids) + 1},
        }
        if prefill:
            reply["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.name, "remote_request_id": "r",
                "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": 1,
                "tp_size": 1}
        return web.json_response(reply)

    async def _prefill(self, ids: list[int]) -> None:
        hashes = block_hashes(ids, BS)
        async with self._lock:  # one prefill at a time: a busy engine queues
            hit = 0
            for h in hashes:
                if h not in self.lru:
                    break
                hit += 1
            for h in reversed(hashes[:hit]):
                self.lru.move_to_end(h)
            self.requests += 1
            self.prompt_tokens += len(ids)
            self.hit_tokens += hit * BS
            await asyncio.sleep((len(ids) - hit * BS) * self.us_per_token / 1e6)
            self._store(hashes, hit, ids)

    def _store(self, hashes: list[int], hit: int, ids: list[int]) -> None:
        events: list[CacheEvent] = []
        new = hashes[hit:]
        if new:
            parent = hashes[hit - 1] if hit else None
            tokens = tuple(ids[hit * BS : len(hashes) * BS])
            events.append(BlockStoredEvent(tuple(new), parent, tokens))
            for h in new:
                self.lru[h] = None
        evicted = []
        while len(self.lru) > self.capacity:
            evicted.append(self.lru.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemovedEvent(tuple(evicted)))
        if self.publisher is not None:
            self.publisher.publish(events)


@dataclass(frozen=True)
class Request:
    ids: list[int]
    user: str
    oracle_hit: int  # tokens an ideal router would find cached


def workload(n_requests: int, seed: int) -> list[Request]:
    """32 system prompts x 8 users x 3 turns + 25% unique prompts, shuffled, cut to size."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 500) for _ in range(16 * BS)] for _ in range(32)]
    items: list[tuple[int | None, int]] = [
        (s, s * 8 + u) for s in range(32) for u in range(8) for _ in range(3)
    ]
    items += [(None, 10_000 + i) for i in range(len(items) // 3)]
    rng.shuffle(items)
    seen: set[int] = set()
    out = []
    for system, user in items[:n_requests]:
        tail = [rng.randrange(3, 500) for _ in range(2 * BS)]
        if system is None:
            out.append(Request([rng.randrange(3, 500) for _ in range(18 * BS)], f"u{user}", 0))
            continue
        out.append(Request(systems[system] + tail, f"u{user}",
                           16 * BS if system in seen else 0))
        seen.add(system)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _ok(request: web.Request) -> web.Response:
    return web.Response()


@contextlib.asynccontextmanager
async def engines(n: int, role: str, args: argparse.Namespace) -> AsyncIterator[
        list[tuple[str, CacheEngine]]]:
    started: list[tuple[str, CacheEngine, web.AppRunner]] = []
    try:
        for i in range(n):
            pub = KVEventPublisher("tcp://127.0.0.1:*", BS, ShimMetrics.create())
            pub.start()
            eng = CacheEngine(f"{role}{i}", args.cache_blocks, args.us_per_token, pub)
            app = web.Application()
            app.router.add_post("/v1/completions", eng.handle)
            app.router.add_get("/health", _ok)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            port = _free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            started.append((f"http://127.0.0.1:{port}", eng, runner))
        yield [(url, eng) for url, eng, _ in started]
    finally:
        for _, eng, runner in started:
            await runner.cleanup()
            if eng.publisher is not None:
                eng.publisher.close()


@contextlib.asynccontextmanager
async def router(config: RouterConfig, tokenizer: Any) -> AsyncIterator[str]:
    app = create_app(config, registry=CollectorRegistry(), tokenizer=tokenizer)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def run_policy(policy: str, reqs: list[Request], args: argparse.Namespace,
                     tokenizer: Any, model_dir: Path) -> dict[str, float]:
    async with engines(2, "P", args) as ps, engines(2, "D", args) as ds:
        config = RouterConfig(
            model=str(model_dir), prefill=[u for u, _ in ps], decode=[u for u, _ in ds],
            prefill_policy=policy, decode_policy="least-inflight", prefix_block_size=BS,
            max_model_len=4096, health_interval_s=3600.0,
            kv_events=[f"{u}={e.publisher.endpoint}" for u, e in ps if e.publisher],
        )
        async with router(config, tokenizer) as url:
            await asyncio.sleep(0.3)  # PUB/SUB: let subscriptions reach the publishers
            ttfts = await drive(url, reqs, args.concurrency)
        prompt = sum(e.prompt_tokens for _, e in ps)
        hits = sum(e.hit_tokens for _, e in ps)
        counts = [e.requests for _, e in ps]
    oracle = sum(r.oracle_hit for r in reqs) / sum(len(r.ids) for r in reqs)
    hit_rate = hits / prompt
    return {"hit_rate": hit_rate, "oracle_hit_rate": oracle,
            "vs_oracle": hit_rate / oracle if oracle else 0.0,
            "imbalance": max(counts) / max(1, min(counts)),
            "mean_ttft_ms": statistics.fmean(ttfts) * 1000,
            "p99_ttft_ms": sorted(ttfts)[int(len(ttfts) * 0.99) - 1] * 1000}


async def drive(url: str, reqs: list[Request], concurrency: int) -> list[float]:
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    ttfts: list[float] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            r = queue.get_nowait()
            t0 = time.perf_counter()
            body = {"prompt": r.ids, "max_tokens": 1, "user": r.user}
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"router answered {resp.status}")
            ttfts.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return ttfts


def print_table(results: dict[str, dict[str, float]]) -> None:
    print(f"{'policy':<16}{'hit rate':>10}{'oracle':>9}{'vs oracle':>11}{'max/min':>9}"
          f"{'mean TTFT':>12}{'p99 TTFT':>11}")
    for name, r in results.items():
        print(f"{name:<16}{r['hit_rate']:>10.1%}{r['oracle_hit_rate']:>9.1%}"
              f"{r['vs_oracle']:>11.1%}{r['imbalance']:>9.2f}{r['mean_ttft_ms']:>10.1f}ms"
              f"{r['p99_ttft_ms']:>9.1f}ms")


async def main_async(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    model_dir = ensure_tiny_model()
    tokenizer = load_tokenizer(str(model_dir), str(model_dir), 4096)
    reqs = workload(args.requests, args.seed)
    results = {}
    for policy in args.policies:
        results[policy] = await run_policy(policy, reqs, args, tokenizer, model_dir)
        print(f"# {policy}: done", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=768,
                        help="prefix cache size of each fake engine, in 16-token blocks")
    parser.add_argument("--us-per-token", type=float, default=40.0,
                        help="simulated prefill cost of one uncached token (microseconds)")
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print a JSON line last")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    print_table(results)
    if args.json:
        print(json.dumps({"bench": "routing", "engines": "fake (simulated prefix cache)",
                          "requests": args.requests, "concurrency": args.concurrency,
                          "results": results}))


if __name__ == "__main__":
    main()
