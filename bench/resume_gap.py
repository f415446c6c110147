"""Mid-stream migration's resume gap against a full recompute of the same prefix on D
(shim engines; `bench/e2e.py --resume-gap` runs it, `--device cuda` on a GPU node).

Per mode (pull, notify, push) a cluster of one prefill and `--rounds` + 1 decode engines is
started (`python -m pdgate.engine_shim` engines and a `python -m pdgate.router`, as
tests/chaos does), then `--rounds` times: one greedy stream of `--max-tokens` tokens over a
~`--prompt-tokens` prompt goes through the router; after `--kill-after` chunks its decode
engine is `kill -9`ed and the router continues the stream on another decode engine (P
prefills prompt + generated tokens, the KV moves). Each round kills one more engine (none
is restarted: a restart costs seconds and would dominate the run). Printed per mode, p50 over the
rounds:
- `gap ms`: the client's longest pause between two chunks of the migrated stream (kill to
  the continuation's first chunk, as the client sees it);
- `router gap ms`: the router's `pdgate_migration_resume_gap_seconds` (its decode failure
  detected to the continuation's first byte relayed), mean over the rounds;
- `recompute ms`: TTFT of the same prefix (prompt + the tokens before the cut) sent to a
  decode engine alone, which computes all of it: what a migration without KV transfer
  (Dynamo-style re-issue) waits for the prefill part, HTTP included;
- `P/D same prefix ms`: TTFT of that prefix through the router with no fault (P prefills,
  KV moves to D): the continuation's cost without failure detection.

    python bench/e2e.py --resume-gap [--device cuda] [--prompt-tokens 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODES = ("pull", "notify", "push")
_SECRET = "bench-resume-gap-secret-0123456789"


class _Proc:
    """One child process (an engine or the router) that can be killed and started again."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log = argv, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=out, stderr=out)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)  # only the process this bench started
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait(url: str, path: str, ok: Any, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + path, timeout=1)
            if ok(r):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}{path} not ready after {timeout}s")


class Cluster:
    """One prefill and `decodes` decode shim engines and a router in `mode`, on ports from
    `base` (2 * (decodes + 1) + 1 of them)."""

    def __init__(self, mode: str, base: int, model: str, device: str, log_dir: Path,
                 decodes: int) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.engines: list[tuple[str, _Proc]] = []
        n = decodes + 1
        for i, role in enumerate(("prefill", *(["decode"] * decodes))):
            port, side = base + 1 + i, base + 1 + n + i
            argv = [sys.executable, "-m", "pdgate.engine_shim", "--model", model,
                    "--host", "127.0.0.1", "--port", str(port), "--device", device,
                    "--block-size", "16", "--num-blocks", "2048", "--engine-id", f"{role}{i}",
                    "--side-channel-host", "127.0.0.1", "--side-channel-port", str(side),
                    "--notify-secret", _SECRET]
            self.engines.append((role, _Proc(argv, log_dir / f"{role}{i}.log")))
        self.url = f"http://127.0.0.1:{base}"
        argv = [sys.executable, "-m", "pdgate.router", "--host", "127.0.0.1",
                "--port", str(base), "--model", model, "--pd-mode", mode,
                "--notify-secret", _SECRET, "--health-interval-s", "0.3",
                "--breaker-open-s", "2", "--log-level", "warning"]
        for i, (role, _) in enumerate(self.engines):
            argv += [f"--{role}", self.engine_url(i)]
        self.router = _Proc(argv, log_dir / "router.log")

    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{int(self.url.rsplit(':', 1)[1]) + 1 + i}"

    def start(self) -> None:
        for _, p in self.engines:
            p.start()
        for i in range(len(self.engines)):
            _wait(self.engine_url(i), "/health", lambda r: r.status_code == 200)
        self.router.start()
        self.wait_pairs()

    def wait_pairs(self) -> None:
        decodes = sum(1 for role, p in self.engines if role == "decode"
                      and p.proc is not None and p.proc.poll() is None)
        _wait(self.url, "/ready", lambda r: r.json().get("decode_healthy") == decodes
              and r.json().get("prefill_healthy") == 1)

    def alive_decode(self) -> int:
        """The index of a decode engine still running."""
        return next(i for i, (role, p) in enumerate(self.engines) if role == "decode"
                    and p.proc is not None and p.proc.poll() is None)

    def kill_decode(self, url: str) -> None:
        i = next(i for i in range(len(self.engines)) if self.engine_url(i) == url)
        self.engines[i][1].kill()

    def stop(self) -> None:
        self.router.stop()
        for _, p in self.engines:
            p.stop()


def _prompt(i: int, tokens: int) -> str:
    """bench/e2e.py's prompt: `tokens` tiny-tokenizer tokens (the Greek-letter words this
    used before are 4-5 tokens each: `--prompt-tokens 480` was 2,164 tokens)."""
    from bench.e2e import prompt

    return prompt(i, tokens)


async def _migrated_stream(c: Cluster, text: str, args: argparse.Namespace) -> float:
    """One stream whose decode engine is killed after `kill_after` chunks; the longest
    pause the client saw between two chunks (s)."""
    body = {"prompt": text, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks, last, gap, victim = 0, 0.0, 0.0, None
    async with httpx.AsyncClient(base_url=c.url, timeout=300) as client, \
            client.stream("POST", "/v1/completions", json=body) as r:
        victim = r.headers.get("x-pdgate-decode-engine")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if '"error"' in line:
                raise RuntimeError(f"the stream was not migrated: {line[:200]}")
            now = time.perf_counter()
            if last:
                gap = max(gap, now - last)
            last = now
            chunks += 1
            if chunks == args.kill_after and victim:
                c.kill_decode(victim)
    return gap


async def _ttft(url: str, body: dict[str, Any]) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return time.perf_counter() - t0
    raise RuntimeError("no chunk")


def _prefix(c: Cluster, text: str, tokens: int) -> list[int]:
    """The prompt's ids plus its first `tokens` greedy tokens (from a decode engine)."""
    r = httpx.post(c.engine_url(c.alive_decode()) + "/v1/completions", timeout=300, json={
        "prompt": text, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    if r.status_code != 200:
        raise RuntimeError(f"the decode engine answered {r.status_code}: {r.text[:500]}")
    choice = r.json()["choices"][0]
    return list(choice["prompt_token_ids"]) + list(choice["token_ids"])


def _router_gap(c: Cluster, mode: str) -> tuple[float, float]:
    text = httpx.get(c.url + "/metrics", timeout=10).text
    values = {}
    for name in ("sum", "count"):
        m = re.search(rf'^pdgate_migration_resume_gap_seconds_{name}\{{mode="{mode}"\}} (\S+)',
                      text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    return values["sum"], values["count"]


def measure(mode: str, args: argparse.Namespace, base: int, log_dir: Path) -> dict[str, float]:
    c = Cluster(mode, base, args.model, args.device, log_dir, args.rounds + 1)
    # bench/e2e.py's --prompt-tokens takes several values (its grid); the first is used.
    tokens = args.prompt_tokens[0] if isinstance(args.prompt_tokens, list) \
        else args.prompt_tokens
    try:
        c.start()
        gaps, recompute, pd = [], [], []
        for i in range(args.rounds):
            text = _prompt(1000 + i, tokens)
            gaps.append(asyncio.run(_migrated_stream(c, text, args)))
            c.wait_pairs()  # the router has seen the kill
            prefix = _prefix(c, _prompt(2000 + i, tokens), args.kill_after)
            one = {"prompt": prefix, "max_tokens": 1, "temperature": 0, "stream": True}
            recompute.append(asyncio.run(_ttft(c.engine_url(c.alive_decode()), one)))
            pd.append(asyncio.run(_ttft(c.url, {**one, "max_tokens": 2})))
        total, count = _router_gap(c, mode)
    finally:
        c.stop()
    return {"gap_p50_ms": 1000 * statistics.median(gaps),
            "router_gap_mean_ms": 1000 * total / count if count else float("nan"),
            "migrations": count,
            "recompute_p50_ms": 1000 * statistics.median(recompute),
            "pd_prefix_p50_ms": 1000 * statistics.median(pd)}


def table(figures: dict[str, dict[str, float]]) -> str:
    head = (f"{'mode':<7} {'gap ms':>8} {'router gap ms':>14} {'migrations':>11} "
            f"{'recompute ms':>13} {'P/D same prefix ms':>19}")
    rows = [head, "-" * len(head)]
    for mode, f in figures.items():
        rows.append(f"{mode:<7} {f['gap_p50_ms']:>8.1f} {f['router_gap_mean_ms']:>14.1f} "
                    f"{f['migrations']:>11.0f} {f['recompute_p50_ms']:>13.1f} "
                    f"{f['pd_prefix_p50_ms']:>19.1f}")
    return "\n".join(rows)
