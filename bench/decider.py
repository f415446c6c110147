"""The measured-cost decider against the static one, on shim engines (tiny model, CPU).

One command, two clusters of 2 prefill + 2 decode shim engines behind `pdgate up`, the same
load on each: the static decider (every prompt through P then D), then `--decider
measured-cost`. The load has two phases:

1. a prefill-heavy burst: `--burst` streaming requests of `--long-tokens`-token prompts and
   4 generated tokens, `--burst-concurrency` at once (the prefill pool queues), or with
   `--burst-rate` at that many a second whatever is in flight (an open loop: in a closed
   loop the clients' requests are all queued somewhere, so a decider that unloads P shows
   as throughput; at a fixed rate above P's throughput, as P's queue not growing);
2. a mixed phase: `--mixed` requests, half long prompts with 4 tokens and half
   `--short-tokens`-token prompts with `--decode-tokens` tokens in an order shuffled by
   `--seed`, `--mixed-concurrency` at once.

Per phase and decider: TTFT p90 and request latency p90 (client side: send -> first
content chunk, send -> [DONE]), the p90 of each stream's longest gap between two chunks
(the stall a prompt computed beside it on its D caused), the phase's requests per second
(each worker sends its next request when answered: a decider that unloads a saturated pool
shows it here as much as in the p90s), the router's decisions by reason, its decider mode
switches per second (a bucket's held mode changing) and overrides per second (a request
taking the mode its bucket does not hold, predicted cheaper by more than the margin), and
how close its predictions were: the share of requests whose measured TTFT (from the
decision) was within +-25 % of the predicted one, and the median measured / predicted ratio
(`pdgate_decider_prediction_ratio`); `--json` splits them by choice (D alone, P then D).
Beside it, two reference predictors on the same requests (bench/prediction_bound.py), each
taking a prompt's service time as the engine's median and the transfer as it was: `queue`
knows the prompts ahead of each request on its engine (a queue model with the best figures),
`bound` knows its wait itself (the services ahead too: what the engines' own variation leaves
to any prediction at all).

    python bench/decider.py [--burst 48] [--mixed 48] [--device cuda] [--json]

All engines and the router share the machine's cores: compare the two deciders within one
run, not across machines. On a CPU machine the pools can be given cores of their own, as P
and D pools have their own GPUs (the router and the load generator still share them):

    python bench/decider.py --up-arg=--prefill-engine-arg=--cpus=0 \
        --up-arg=--decode-engine-arg=--cpus=1

or, with cores to spare, each engine its own (engine i on cores 2i..2i+1; the router and
the load generator on the rest):

    taskset -c 8-15 python bench/decider.py --up-arg=--cores-per-engine=2

`--step-budget 2048` gives the engines vLLM's step budget (a step computes prompts first
come first served while 2,048 tokens last): without it a shim step runs every waiting
prompt, all finishing together, which no FIFO queue model predicts per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.e2e import _free_base, launch, one, prompt, stop  # noqa: E402
from bench.prediction_bound import access_lines, shares  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DECIDERS = ("static", "measured-cost")
# A 1,500-token prefill of the tiny model takes ~0.1-0.2 s on one CPU core. The guard lets
# D alone stall a busy D's streams by at most 0.25 s, and below that the decider weighs the
# stall against what D alone saves (`stall_weight`, 1 by default). Before the stall was
# weighed the bound was all there was: at 0.1 s the mixed phase's short streams paid for
# every long prompt computed beside them (latency p90 +53 % in one pinned run), at 30 ms no
# long prompt ran on a D decoding anything, and the closed-loop burst queued on P. A bucket
# may change mode five times a second (the default 1 s held a mode through most of a
# few-second burst); a mode not held is probed after 0.5 s unmeasured (a GPU burst lasts
# ~2.5 s).
MEASURED_PARAMS = {"margin": 0.2, "min_dwell_s": 0.2, "itl_stall_s": 0.25, "probe_s": 0.5}


def start(decider: str, tmp: Path, device: str = "cpu", up_args: list[str] | None = None,
          params: dict[str, float] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A 2P2D `pdgate up` with `decider`; the process and the router URL once ready."""
    base = _free_base(9)
    config = tmp / f"{decider}.yaml"
    spec = {"type": decider, "params": {**MEASURED_PARAMS, **(params or {})}} \
        if decider == "measured-cost" else decider
    config.write_text(json.dumps({"decider": spec}))  # JSON is YAML
    argv = [sys.executable, "-m", "pdgate.cli", "up", "--no-demo", "--prefill", "2",
            "--decode", "2", "--port", str(base), "--engine-port-base", str(base + 1),
            "--side-channel-port-base", str(base + 5), "--block-size", "16",
            "--num-blocks", "2048", "--log-dir", str(tmp / decider),
            f"--router-arg=--config={config}", "--router-arg=--tokenize-prompts=always",
            "--device", device, *(up_args or [])]
    return launch(argv, base, decider, tmp / decider, 240.0, engines=4)


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(series name, label text) -> value of the router's decider series."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("pdgate_disagg_decisions_total", "pdgate_decider_")):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            out[(name, labels.rstrip("}"))] = float(value)
    return out


def delta(after: dict[tuple[str, str], float], before: dict[tuple[str, str], float],
          name: str) -> dict[str, float]:
    return {labels: v - before.get((n, labels), 0.0) for (n, labels), v in after.items()
            if n == name and v - before.get((n, labels), 0.0) > 0}


def prediction(ratio_buckets: dict[str, float]) -> dict[str, float | None]:
    """Share within +-25 % and the median ratio, from the histogram's bucket deltas."""
    by_le: dict[float, float] = {}
    for labels, v in ratio_buckets.items():
        le = next(p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("le="))
        by_le[float(le)] = by_le.get(float(le), 0.0) + v
    total = by_le.get(float("inf"), 0.0)
    if not total:
        return {"within_25pct": None, "median_ratio": None, "observed": 0}
    median = next(le for le in sorted(by_le) if by_le[le] >= total / 2)
    # `delta` leaves out buckets that did not grow: their count in this phase is 0.
    within = by_le.get(1.25, 0.0) - by_le.get(0.75, 0.0)
    return {"within_25pct": within / total, "median_ratio_le": median,
            "observed": total}


async def phase(url: str, jobs: list[tuple[str, int]], concurrency: int,
                rate: float = 0.0) -> dict[str, float]:
    """Run `jobs` (prompt, max tokens) `concurrency` at a time (a closed loop), or, with a
    `rate`, one every 1/`rate` seconds whatever is in flight (an open loop); client-side
    p90s."""
    queue = list(jobs)
    results: list[tuple[float, float, float]] = []
    limits = httpx.Limits(max_connections=len(jobs) if rate else concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                text, max_tokens = queue.pop(0)
                results.append(await one(client, text, max_tokens))

        async def at(i: int, text: str, max_tokens: int) -> None:
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            results.append(await one(client, text, max_tokens))

        t0 = time.perf_counter()
        if rate:
            await asyncio.gather(*(at(i, *job) for i, job in enumerate(jobs)))
        else:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    lats = sorted(r[1] for r in results)
    gaps = sorted(r[2] for r in results)
    p90 = int(0.9 * (len(results) - 1))
    # A stream's longest gap between two chunks: what a prompt computed beside it on its D
    # stalled it by (the ITL the decider's guard and stall cost protect).
    return {"ttft_p90_ms": 1000 * ttfts[p90], "latency_p90_ms": 1000 * lats[p90],
            "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2], "gap_p90_ms": 1000 * gaps[p90],
            "seconds": wall}


def phase_lines(log: Path, offset: int, requests: int) -> list[dict[str, Any]]:
    """The phase's access lines from the router's log (from `offset`), once all `requests`
    are there: the router writes a line after the answer's last byte (5 s at most)."""
    deadline = time.monotonic() + 5.0
    while True:
        with log.open("rb") as f:
            f.seek(offset)
            lines = access_lines(f.read().decode(errors="replace").splitlines())
        if len(lines) >= requests or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def workload(args: argparse.Namespace
             ) -> dict[str, tuple[list[tuple[str, int]], int, float]]:
    burst = [(prompt(i, args.long_tokens), 4) for i in range(args.burst)]
    mixed = [(prompt(10_000 + i, args.long_tokens), 4) if i % 2 == 0 else
             (prompt(10_000 + i, args.short_tokens), args.decode_tokens)
             for i in range(args.mixed)]
    # Half long, half short, in an order fixed by the seed but not strictly alternating:
    # with long and short requests taking turns, a D pick whose tie-breaker rotates once a
    # request (least-inflight, the static decider's) put 42-47 of 48 short streams on one D
    # and the long prompts' D legs on the other in every GPU run, a placement the order
    # made, not either decider (docs/benchmarks.md).
    random.Random(args.seed).shuffle(mixed)
    return {"burst": (burst, args.burst_concurrency, args.burst_rate),
            "mixed": (mixed, args.mixed_concurrency, 0.0)}


def run_one(decider: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    proc, url = start(decider, tmp, args.device, args.up_arg, json.loads(args.params))
    figures: dict[str, Any] = {}
    log = tmp / decider / "router.log"
    try:
        asyncio.run(phase(url, [(prompt(90_000 + i, args.long_tokens), 4)
                                for i in range(4)], 1))  # warm-up: KV links, first rates
        for name, (jobs, conc, rate) in workload(args).items():
            before, log_from = scrape(url), log.stat().st_size
            f = asyncio.run(phase(url, jobs, conc, rate))
            after = scrape(url)
            f["bound"] = shares(phase_lines(log, log_from, len(jobs)))
            switches = sum(delta(after, before, "pdgate_decider_switches_total").values())
            f["decisions"] = delta(after, before, "pdgate_disagg_decisions_total")
            f["switches_per_s"] = switches / f["seconds"]
            # Requests that took the mode their bucket did not hold (cheaper by the margin)
            overrides = sum(delta(after, before, "pdgate_decider_overrides_total").values())
            f["overrides_per_s"] = overrides / f["seconds"]
            # A closed loop: clients send again as soon as they are answered, so what a
            # decider gains on a saturated pool shows as throughput more than as p90s.
            f["req_per_s"] = len(jobs) / f["seconds"]
            ratios = delta(after, before, "pdgate_decider_prediction_ratio_bucket")
            f["prediction"] = prediction(ratios)
            f["prediction_by_choice"] = {  # which prediction misses: D alone or P then D
                choice: prediction({k: v for k, v in ratios.items()
                                    if f'choice="{choice}"' in k})
                for choice in ("direct", "disagg")}
            figures[name] = f
    finally:
        stop(proc)
    print(f"  {decider} done", file=sys.stderr, flush=True)
    return figures


def table(figures: dict[str, Any]) -> str:
    head = (f"{'phase':<6} {'decider':<14} {'TTFT p50':>9} {'TTFT p90':>9} {'lat p90':>9} "
            f"{'gap p90':>8} {'req/s':>7} {'switch/s':>9} {'over/s':>7} {'pred +-25%':>10} "
            f"{'queue':>6} {'bound':>6}  "
            "decisions")
    rows = [head, "-" * len(head)]
    for phase_name in ("burst", "mixed"):
        for decider in figures:
            f = figures[decider][phase_name]
            within = f["prediction"]["within_25pct"]
            queue = f["bound"]["queue_within_25pct"]
            bound = f["bound"]["bound_within_25pct"]
            decisions = ", ".join(f"{k.split('=')[-1].strip(chr(34))} {int(v)}"
                                  for k, v in sorted(f["decisions"].items()))
            rows.append(f"{phase_name:<6} {decider:<14} {f['ttft_p50_ms']:>9.1f} "
                        f"{f['ttft_p90_ms']:>9.1f} {f['latency_p90_ms']:>9.1f} "
                        f"{f['gap_p90_ms']:>8.1f} {f['req_per_s']:>7.1f} "
                        f"{f['switches_per_s']:>9.2f} "
                        f"{f['overrides_per_s']:>7.2f} "
                        f"{'-' if within is None else f'{100 * within:.0f} %':>10} "
                        f"{'-' if queue is None else f'{100 * queue:.0f} %':>6} "
                        f"{'-' if bound is None else f'{100 * bound:.0f} %':>6}  "
                        f"{decisions}")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst", type=int, default=48, help="requests in the burst")
    p.add_argument("--burst-concurrency", type=int, default=16)
    p.add_argument("--burst-rate", type=float, default=0.0, metavar="PER_S",
                   help="send the burst open loop, this many requests a second whatever is "
                        "in flight (0, the default: --burst-concurrency clients, each "
                        "sending again when answered)")
    p.add_argument("--mixed", type=int, default=48, help="requests in the mixed phase")
    p.add_argument("--mixed-concurrency", type=int, default=6)
    p.add_argument("--seed", type=int, default=0,
                   help="the mixed phase's order of long and short requests")
    p.add_argument("--long-tokens", type=int, default=1500, help="long prompts' length")
    p.add_argument("--short-tokens", type=int, default=64, help="short prompts' length")
    p.add_argument("--decode-tokens", type=int, default=48,
                   help="tokens generated by the mixed phase's short prompts")
    p.add_argument("--device", default="cpu",
                   help="engines' device: cpu, cuda, cuda:N, or a comma list taken in turn")
    p.add_argument("--up-arg", action="append", default=[],
                   help="extra `pdgate up` flag (repeatable), e.g. "
                        "--up-arg=--decode-engine-arg=--device=cuda:1")
    p.add_argument("--step-budget", type=int, default=0, metavar="TOKENS",
                   help="the engines' --max-num-batched-tokens (vLLM's step budget; "
                        "0, the default: the shim's, none: a step runs every waiting prompt)")
    p.add_argument("--params", default="{}", metavar="JSON",
                   help="measured-cost params over the bench's "
                        f"{json.dumps(MEASURED_PARAMS)}, e.g. '{{\"min_dwell_s\": 0.2}}'")
    p.add_argument("--json", action="store_true", help="print figures as JSON last line")
    p.add_argument("--keep-logs", default=None, metavar="DIR",
                   help="copy each cluster's logs (JSON lines: the router's access log has "
                        "each request's decision, predicted and measured TTFT) into DIR")
    args = p.parse_args()
    args.up_arg = [*args.up_arg, "--log-format=json"]  # the access lines `bound` reads
    if args.step_budget:
        args.up_arg = [*args.up_arg, f"--engine-arg=--max-num-batched-tokens={args.step_budget}"]
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-decider-") as tmp:
        figures = {d: run_one(d, args, Path(tmp)) for d in DECIDERS}
        if args.keep_logs:
            for d in DECIDERS:
                shutil.copytree(Path(tmp) / d, Path(args.keep_logs) / d, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("engine-api-key"))
    print(table(figures))
    if args.json:
        print(json.dumps({"decider": figures, "config": vars(args)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
