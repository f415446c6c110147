"""Scorers shared by policies. Each returns one value per candidate, higher is better;
the runner clamps to [0, 1] and applies the policy's weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdgate.router.policies.base import PickContext, PolicyEnv
from pdgate.router.pool import Endpoint

__all__ = ["LoadScorer", "PrefixScorer", "SpreadScorer", "TextPrefixScorer"]


class LoadScorer:
    """1 / (1 + requests in flight): 1 for an idle engine, falling towards 0."""

    name: ClassVar[str] = "load"
    needs_tokens: ClassVar[bool] = False
    reads_text: ClassVar[bool] = False

    def score(self, candidates: Sequence[Endpoint], ctx: PickContext) -> list[float]:
        return [1.0 / (1 + ep.in_flight) for ep in candidates]


class PrefixScorer:
    """Fraction of the prompt's full blocks the engine already holds (longest matching
    prefix). `use_events`: trust engines' KV events where an engine publishes them."""

    name: ClassVar[str] = "prefix"
    needs_tokens: ClassVar[bool] = True  # hashes the prompt's token blocks
    reads_text: ClassVar[bool] = False

    def __init__(self, env: PolicyEnv, *, use_events: bool) -> None:
        self._env = env
        self._use_events = use_events

    def score(self, candidates: Sequence[Endpoint], ctx: PickContext) -> list[float]:
        hashes = ctx.block_hashes(self._env.block_size)
        if not hashes:
            return [0.0] * len(candidates)
        urls = [ep.key for ep in candidates]
        matched = self._env.matched_blocks(hashes, urls, use_events=self._use_events)
        return [matched.get(u, 0) / len(hashes) for u in urls]


class TextPrefixScorer:
    """Fraction of the prompt text's full blocks (`env.block_chars` characters) the
    engine is believed to hold, from the router's own index of past routing decisions.
    No tokenizer: the prompt is cut into character blocks, as vllm-router's cache-aware
    policy matches characters."""

    name: ClassVar[str] = "text-prefix"
    needs_tokens: ClassVar[bool] = False
    reads_text: ClassVar[bool] = True

    def __init__(self, env: PolicyEnv) -> None:
        self._env = env

    def score(self, candidates: Sequence[Endpoint], ctx: PickContext) -> list[float]:
        hashes = ctx.text_hashes(self._env.block_chars)
        if not hashes:
            return [0.0] * len(candidates)
        urls = [ep.key for ep in candidates]
        matched = self._env.approx.match(hashes, urls)
        return [matched.get(u, 0) / len(hashes) for u in urls]


class SpreadScorer:
    """Prefers engines believed to hold fewer cached blocks (1 - own / largest), so new
    prefixes spread over the engines instead of piling onto one."""

    name: ClassVar[str] = "spread"
    needs_tokens: ClassVar[bool] = False
    reads_text: ClassVar[bool] = False

    def __init__(self, env: PolicyEnv) -> None:
        self._env = env

    def score(self, candidates: Sequence[Endpoint], ctx: PickContext) -> list[float]:
        sizes = [self._env.approx.blocks_of(ep.key) for ep in candidates]
        top = max(sizes)
        return [1.0 - s / top if top else 1.0 for s in sizes]
