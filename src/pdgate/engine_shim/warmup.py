"""Engine warm-up: one prompt run at startup, before the engine reports ready.

A GPU engine's first forward pays CUDA's first use (kernel loading, library handles and
their heuristics): on an H200 host a fresh shim took 1.1 s for its first 1,500-token prompt
and 20 ms for the next. vLLM pays that at startup (its profile run and CUDA graph capture),
so what a router first measures of a vLLM engine is what the engine does; the shim warms up
too, so that its first request, and what a router learns from it (the measured-cost
decider's rates), is representative. The prompt is local (no KV transfer); its blocks go
back to the pool (cached for prefix reuse like any finished prompt's).
"""

from __future__ import annotations

import logging
import time
import uuid

from pdgate.engine_shim.engine import Engine
from pdgate.engine_shim.sampler import SamplingParams
from pdgate.engine_shim.sequence import GenerateRequest

__all__ = ["default_warmup_tokens", "warm_up"]

log = logging.getLogger(__name__)

GPU_WARMUP_TOKENS = 1024


def default_warmup_tokens(device: str) -> int:
    """A GPU engine warms up with a 1,024-token prompt; a CPU one has no first-use cost
    worth a startup delay (and the tests start many)."""
    return GPU_WARMUP_TOKENS if device.startswith("cuda") else 0


async def warm_up(engine: Engine, tokens: int) -> float:
    """Run one greedy prompt of `tokens` tokens (bounded by the context) for two tokens
    through the started `engine`; the seconds it took (0.0: nothing to do)."""
    n = min(tokens, engine.max_model_len - 2)
    if n <= 0:
        return 0.0
    vocab = engine.model.config.vocab_size
    req = GenerateRequest(
        request_id=f"pdgate-warmup-{uuid.uuid4().hex}",
        prompt_ids=tuple(1 + i % (vocab - 1) for i in range(n)),
        sampling=SamplingParams(temperature=0.0), max_tokens=2, ignore_eos=True,
        model=engine.served_model_names[0])
    t0 = time.perf_counter()
    async with await engine.open(req) as stream:
        async for _ in stream:
            pass
    seconds = time.perf_counter() - t0
    log.info("warm-up: a %d-token prompt took %.3f s", n, seconds)
    return seconds
