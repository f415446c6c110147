"""End to end on shim engines (tiny model, CPU): TTFT and throughput of colocated vs pull vs
notify vs push, side by side in one run.

For each mode a fresh 1P1D cluster is started with `pdgate up` (block size 16); "colocated"
is the same cluster shape with `--disagg-min-tokens` above every prompt, so each request
runs on the decode engine alone behind the same router. The load: `--requests` streaming
completions at `--concurrency`, each a distinct ~`--prompt-tokens` prompt and
`--max-tokens` greedy tokens (ignore_eos), after a warm-up. TTFT is client send -> first
content chunk; latency is send -> [DONE]; req/s is requests / wall time. The last two
columns are each mode's TTFT p50 and latency p50 as a ratio to pull's.

    python bench/e2e.py [--requests 64] [--concurrency 4] [--prompt-tokens 480] [--json]

`--prompt-tokens` and `--concurrency` take several values: every mode's cluster is started
once and runs each (prompt length, concurrency) cell, one table per cell, e.g. the GPU grid
of docs/benchmarks.md:

    python bench/e2e.py --device cuda --requests 200 --prompt-tokens 480 4000 \
        --concurrency 1 4 --json

`--resume-gap` measures mid-stream migration instead (bench/resume_gap.py: a decode engine
killed mid-stream, the resume gap against a full recompute of the same prefix on D), per
mode of pull, notify and push; with `--device cuda` on a GPU node.

Every process shares the machine's cores, so absolute figures are noisy; compare ratios
from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODES = ("colocated", "pull", "notify", "push")
# Words the tiny tokenizer (engine_shim/tiny.py) keeps as one token each (" the", " of",
# ...), so `--prompt-tokens N` is N tokens give or take the index: the Greek letters used
# before took 4 to 7 tokens each, so "480-token" prompts were about 1,980 tokens.
WORDS = "the of and to in is for with at by from are one time over world".split()


def _free_base(count: int) -> int:
    for base in range(21000, 60000, 97):
        ok = True
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def start(mode: str, log_dir: Path, device: str, router_args: list[str],
          model: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`pdgate up` for `mode` (on `model`, a directory; default the tiny model); returns
    the process and the router URL once ready."""
    base = _free_base(5)
    flags = ["--pd-mode", "pull" if mode == "colocated" else mode, "--device", device,
             *(f"--router-arg={a}" for a in router_args),
             *(["--model", model] if model else [])]
    if mode == "colocated":
        flags.append("--router-arg=--disagg-min-tokens=1000000")
    argv = [sys.executable, "-m", "pdgate.cli", "up", "--no-demo", "--port", str(base),
            "--engine-port-base", str(base + 1), "--side-channel-port-base", str(base + 3),
            "--block-size", "16", "--num-blocks", "2048", "--log-dir", str(log_dir), *flags]
    return launch(argv, base, mode, log_dir, 180.0)


def launch(argv: list[str], port: int, what: str, log_dir: Path,
           timeout: float, engines: int = 2) -> tuple[subprocess.Popen[bytes], str]:
    """Start `pdgate up` (`argv`) and wait until its router on `port` is ready and sees
    all its `engines` healthy; the process and the router URL (the process stopped, and an
    error, if it never is). The router is ready with one pair: a run that starts then
    spends its first seconds on part of the cluster (on a GPU host, a decider bench's whole
    burst ran on one P and one D while the others' health checks came due)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdgate up ({what}) exited; logs in {log_dir}")
        try:
            r = httpx.get(url + "/ready", timeout=1)
            seen = r.json() if r.status_code == 200 else {}
            if seen.get("prefill_healthy", 0) + seen.get("decode_healthy", 0) >= engines:
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"pdgate up ({what}) not ready; logs in {log_dir}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def prompt(i: int, tokens: int) -> str:
    # Distinct per request (no cross-request reuse); 1 token per word for the tiny tokenizer.
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(tokens)]
    return f"{i} " + " ".join(words)


async def one(client: httpx.AsyncClient, text: str,
              max_tokens: int) -> tuple[float, float, float]:
    """One streaming request: (TTFT, latency, the longest gap between two chunks) seconds."""
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft = gap = 0.0
    last = t0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if ttft:
                    gap = max(gap, now - last)
                else:
                    ttft = now - t0
                last = now
    return ttft, time.perf_counter() - t0, gap


async def load(url: str, args: argparse.Namespace, offset: int,
               headers: dict[str, str] | None = None, *, prompt_tokens: int | None = None,
               concurrency: int | None = None) -> dict[str, float]:
    """One cell: `args.requests` requests of `prompt_tokens` at `concurrency` (default: the
    first value of each flag)."""
    tokens = prompt_tokens or _first(args.prompt_tokens)
    conc = concurrency or _first(args.concurrency)
    limits = httpx.Limits(max_connections=conc * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits,
                                 headers=headers) as client:
        for i in range(args.warmup):
            await one(client, prompt(offset - i - 1, tokens), args.max_tokens)
        queue = list(range(offset, offset + args.requests))
        results: list[tuple[float, float, float]] = []

        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await one(client, prompt(i, tokens), args.max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    lats = sorted(r[1] for r in results)
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "latency_p50_ms": 1000 * statistics.median(lats),
        "req_per_s": len(results) / wall,
    }


def _first(value: int | list[int]) -> int:
    return value[0] if isinstance(value, list) else value


def cells(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Every (prompt tokens, concurrency) pair the flags ask for."""
    return [(t, c) for t in args.prompt_tokens for c in args.concurrency]


@contextlib.contextmanager
def work_dir(args: argparse.Namespace, prefix: str) -> Iterator[str]:
    """Where the run's engines and routers write their logs: `--keep-logs` (kept), else a
    temporary directory removed at the end."""
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
        yield args.keep_logs
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Figures per cell `"<prompt tokens>x<concurrency>"`, then per mode."""
    figures: dict[str, Any] = {f"{t}x{c}": {} for t, c in cells(args)}
    with work_dir(args, "pdgate-bench-e2e-") as tmp:
        for mode in args.modes:
            proc, url = start(mode, Path(tmp) / mode, args.device, args.router_arg, args.model)
            try:
                for n, (t, c) in enumerate(cells(args)):
                    # The same prompts in every mode (distinct per cell: no cache reuse).
                    figures[f"{t}x{c}"][mode] = asyncio.run(load(
                        url, args, 10_000 + 100_000 * n, prompt_tokens=t, concurrency=c))
            finally:
                stop(proc)
            print(f"  {mode:<10} done", file=sys.stderr, flush=True)
    return {cell: add_pull_ratios(f) for cell, f in figures.items()}


def add_pull_ratios(figures: dict[str, Any]) -> dict[str, Any]:
    """Each mode's TTFT and latency p50 as a ratio to pull's (when pull ran)."""
    pull = figures.get("pull")
    for f in figures.values():
        if pull:
            f["ttft_vs_pull"] = f["ttft_p50_ms"] / pull["ttft_p50_ms"]
            f["latency_vs_pull"] = f["latency_p50_ms"] / pull["latency_p50_ms"]
    return figures


def table(figures: dict[str, Any]) -> str:
    head = (f"{'mode':<10} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'lat p50 ms':>11} "
            f"{'req/s':>7} {'TTFT/pull':>10} {'lat/pull':>9}")
    rows = [head, "-" * len(head)]
    for mode, f in figures.items():
        rows.append(f"{mode:<10} {f['ttft_p50_ms']:>12.1f} {f['ttft_p90_ms']:>12.1f} "
                    f"{f['latency_p50_ms']:>11.1f} {f['req_per_s']:>7.2f} "
                    f"{f.get('ttft_vs_pull', float('nan')):>10.2f} "
                    f"{f.get('latency_vs_pull', float('nan')):>9.2f}")
    return "\n".join(rows)


def run_resume_gap(args: argparse.Namespace) -> int:
    """`--resume-gap`: bench/resume_gap.py for each of pull, notify and push in `--modes`."""
    sys.path.insert(0, str(ROOT))
    from bench import resume_gap
    from pdgate.engine_shim.tiny import ensure_tiny_model

    # A `timeout` or Ctrl-C must still stop the engines this run started (finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if args.max_tokens <= args.kill_after:
        args.max_tokens = 4 * args.kill_after  # the default 8 would end before the kill
    figures = {}
    with work_dir(args, "pdgate-bench-resume-") as tmp:
        if args.model is None:
            args.model = str(ensure_tiny_model(Path(tmp) / "tiny"))
        for mode in (m for m in args.modes if m in resume_gap.MODES):
            ports = 2 * (args.rounds + 2) + 1
            figures[mode] = resume_gap.measure(mode, args, _free_base(ports),
                                               Path(tmp) / mode)
            print(f"  {mode:<10} done", file=sys.stderr, flush=True)
    print(resume_gap.table(figures))
    if args.json:
        print(json.dumps({"resume_gap": figures, "config": {
            "prompt_tokens": args.prompt_tokens[0], "max_tokens": args.max_tokens,
            "kill_after": args.kill_after, "rounds": args.rounds, "device": args.device}}))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64, help="measured requests per mode")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4],
                   help="requests in flight (several values: one cell each)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[480],
                   help="approx. prompt length (several values: one cell each)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests first")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--device", default="cpu", help="engines' device: cpu, cuda, cuda:N")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra `pdgate router` flag for every mode (repeatable), e.g. "
                        "--router-arg=--no-early-first-token")
    p.add_argument("--json", action="store_true", help="print figures as JSON last line")
    p.add_argument("--keep-logs", default=None, metavar="DIR",
                   help="write the engines' and routers' logs under DIR and keep them")
    p.add_argument("--resume-gap", action="store_true",
                   help="measure mid-stream migration (bench/resume_gap.py) instead")
    p.add_argument("--rounds", type=int, default=3,
                   help="--resume-gap: migrated streams per mode (one more decode engine "
                        "each)")
    p.add_argument("--kill-after", type=int, default=16,
                   help="--resume-gap: chunks of the stream before its decode engine dies")
    p.add_argument("--model", default=None,
                   help="the engines' model directory (default: the tiny model; "
                        "bench/llama8b_shape.py builds Llama-3-8B's layer shape)")
    args = p.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if args.resume_gap:
        return run_resume_gap(args)
    figures = run(args)
    for cell, f in figures.items():
        tokens, conc = cell.split("x")
        print(f"\n{tokens}-token prompts, concurrency {conc}:\n{table(f)}")
    if args.json:
        print(json.dumps({"e2e": figures, "config": {
            "requests": args.requests, "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "device": args.device}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
