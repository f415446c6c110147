"""The shim engine's decode step: what a batch of B sequences costs per token, against the
model's own forward for the same batch, in one process (no HTTP, no router).

A P/D benchmark on shim engines measures the router's decisions over the shim's costs; where
a step of two sequences costs much more than a step of one on a GPU (where the weights' read
dominates and a batch is nearly free), the shim, not the router, sets the figure. This
separates the two: `forward` is `LlamaModel.forward_paged_batch` alone (synchronised), `step`
the engine's inter-token time seen by a request's stream (scheduling, sampling, the event
loop), for B requests decoding together.

    python bench/shim_step.py --model DIR --device cuda [--batches 1,2,4,8,16]
        [--prompt-tokens 480] [--tokens 64] [--json]

`--new-shapes` also times prompts of lengths the engine has not run yet, against the same
length again: an attention kernel that builds a plan per shape (cuDNN's) pays on every new
prompt length and on every decode step whose context crosses a block boundary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _forward_ms(engine: Any, batch: int, context: int, reps: int) -> float:
    """Median ms of one synchronised batched decode forward at `context` tokens each."""
    import torch

    bs = engine.block_size
    per_seq = (context + bs) // bs + 1
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = torch.ones(batch, dtype=torch.long)
    times = []
    for _ in range(reps + 2):
        if str(engine.kv.device).startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.model.forward_paged_batch(ids, [context] * batch, tables, engine.kv)
        if str(engine.kv.device).startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:])


async def _step_ms(engine: Any, batch: int, prompt: int, tokens: int) -> float:
    """Median ms between tokens of `batch` requests decoding together (after every prompt
    is in: intervals from the last first token on)."""
    from pdgate.engine_shim.sampler import SamplingParams
    from pdgate.engine_shim.sequence import GenerateRequest

    vocab = engine.model.config.vocab_size
    stamps: list[list[float]] = [[] for _ in range(batch)]

    async def one(i: int) -> None:
        req = GenerateRequest(
            request_id=f"step-{batch}-{i}-{time.monotonic_ns()}",
            prompt_ids=tuple(1 + (i * 7 + j) % (vocab - 1) for j in range(prompt)),
            sampling=SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True,
            model=engine.served_model_names[0])
        async with await engine.open(req) as stream:
            async for _ in stream:
                stamps[i].append(time.perf_counter())

    await asyncio.gather(*(one(i) for i in range(batch)))
    start = max(s[0] for s in stamps)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if a >= start]
    return 1000 * statistics.median(gaps) if gaps else float("nan")


def _new_shapes(engine: Any) -> list[dict[str, Any]]:
    """ms of one prefill at a length not run before, then the same length again."""
    import torch

    rows = []
    for n in (69, 70, 301, 777, 1501):
        ids = torch.ones(n, dtype=torch.long)
        blocks = list(range((n + engine.block_size - 1) // engine.block_size))
        times = []
        for _ in range(2):
            if str(engine.kv.device).startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.model.forward_paged(ids, 0, blocks, engine.kv, last_only=True)
            if str(engine.kv.device).startswith("cuda"):
                torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - t0))
        rows.append({"prompt": n, "first_ms": round(times[0], 1), "again_ms": round(times[1], 1)})
    return rows


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pdgate.engine_shim.engine import Engine, EngineConfig
    from pdgate.engine_shim.metrics import ShimMetrics

    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * ((args.prompt_tokens + args.tokens) // 16 + 2) + 64
    config = EngineConfig(model=args.model, device=args.device, num_blocks=blocks,
                          max_num_batched_tokens=2048)
    engine = Engine.load(config, ShimMetrics.create())
    await engine.start()
    rows = []
    try:
        await _step_ms(engine, 1, args.prompt_tokens, 4)  # first use (kernels, handles)
        if args.new_shapes:
            rows.extend(_new_shapes(engine))
        for b in batches:
            fwd = _forward_ms(engine, b, args.prompt_tokens, args.reps)
            step = await _step_ms(engine, b, args.prompt_tokens, args.tokens)
            rows.append({"batch": b, "forward_ms": round(fwd, 2), "step_ms": round(step, 2)})
    finally:
        await engine.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="model directory (or tiny)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,2,4,8,16", help="comma list of batch sizes")
    ap.add_argument("--prompt-tokens", type=int, default=480)
    ap.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    ap.add_argument("--reps", type=int, default=20, help="forwards timed per batch size")
    ap.add_argument("--json", action="store_true", help="one JSON line per batch size")
    ap.add_argument("--new-shapes", action="store_true",
                    help="also time prompt lengths run for the first time, then again")
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    one = next(r for r in rows if "batch" in r)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        elif "prompt" in r:
            print(f"prompt {r['prompt']:>5}: first {r['first_ms']:7.1f} ms, "
                  f"again {r['again_ms']:7.1f} ms")
        else:
            print(f"B={r['batch']:>3}  forward {r['forward_ms']:7.2f} ms "
                  f"({r['forward_ms'] / one['forward_ms']:.2f}x B=1)  step {r['step_ms']:7.2f} ms "
                  f"({r['step_ms'] / one['step_ms']:.2f}x B=1)")


if __name__ == "__main__":
    main()
