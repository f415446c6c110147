"""Next-token choice from one logits row: greedy, or temperature / top-k / top-p sampling.

One `Sampler` per request: it owns that request's `torch.Generator`, so a request with a seed
draws the same tokens whatever else the engine is running at the same time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI/vLLM semantics).

    temperature: >= 0; 0 means greedy argmax (top_p, top_k and seed are then unused).
    top_p: nucleus mass in (0, 1]; 1 keeps every token.
    top_k: keep the k most likely tokens; -1 (or 0) turns it off.
    seed: fixes the request's random stream; None draws a fresh one.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive int, got {self.top_k}")
        seed_ok = self.seed is None or (
            isinstance(self.seed, int) and not isinstance(self.seed, bool)
        )
        if not seed_ok:
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks tokens for one request. `sample(logits)` takes a 1-D logits row `[vocab]` (any
    float dtype, any device) and returns the token id. Greedy is deterministic (lowest id wins
    ties); sampled output is reproducible for a given seed on a given device type."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None

    def sample(self, logits: torch.Tensor) -> int:
        if logits.dim() != 1 or logits.numel() == 0:
            raise ValueError(f"logits must be a non-empty 1-D row, got {tuple(logits.shape)}")
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        probs = self._filtered_probs(logits.float() / self.params.temperature)
        token = torch.multinomial(probs, 1, generator=self._generator_for(probs.device))
        return int(token.item())

    def _filtered_probs(self, scaled: torch.Tensor) -> torch.Tensor:
        """Softmax of `scaled` restricted to the top-k, then to the smallest top-p nucleus."""
        p = self.params
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Drop a token when the tokens strictly more likely already reach top_p; the
            # most likely token always survives.
            drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        return probs

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            gen = torch.Generator(device=device)
            if self.params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.params.seed)
            self._generator = gen
        return self._generator
