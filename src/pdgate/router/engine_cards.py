"""What each engine's `GET /v1/models` says about the models it serves: their context
length (`max_model_len`, vLLM's `--max-model-len`) and `root` (the path the engine loaded).

The router's own `/v1/models` reports them as the engines do, rather than what the tokenizer
files say (a model whose config allows 128k tokens is often served with a shorter context).
Learned with the health probe: once per engine, and again after the engine was down (it
may have been restarted with other flags). Event loop only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdgate.contract.engine_replies import ModelList

__all__ = ["EngineCards"]


@dataclass(frozen=True, slots=True)
class _Card:
    root: str | None
    max_model_len: int | None


class EngineCards:
    """Engine URL -> the base models its `/v1/models` lists (LoRA adapters left out)."""

    def __init__(self) -> None:
        self._cards: dict[str, dict[str, _Card]] = {}

    def knows(self, url: str) -> bool:
        return url in self._cards

    def learn(self, url: str, models: ModelList) -> None:
        self._cards[url] = {c.id: _Card(c.root, c.max_model_len) for c in models.data
                            if c.parent is None}

    def forget(self, url: str) -> None:
        """`url` is down: read it again once it is back."""
        self._cards.pop(url, None)

    def _found(self, urls: Iterable[str], model: str) -> list[_Card]:
        return [card for url in urls if (card := self._cards.get(url, {}).get(model))]

    def max_model_len(self, urls: Iterable[str], model: str) -> int | None:
        """The context length `model` is served with on `urls` (the least, should they
        differ: a request must fit whichever engine it lands on); None when none says."""
        found = [c.max_model_len for c in self._found(urls, model) if c.max_model_len]
        return min(found) if found else None

    def root(self, urls: Iterable[str], model: str) -> str | None:
        """Where the engines on `urls` loaded `model` from (None: none says)."""
        return next((c.root for c in self._found(urls, model) if c.root), None)
