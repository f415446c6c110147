"""Prompt tokenization: a fast HF tokenizer, loaded once per app, with the chat template.

Loaded through `transformers.PreTrainedTokenizerFast` (not `AutoTokenizer`): AutoTokenizer
imports `transformers.configuration_utils`, which imports torch whenever torch is installed,
and the router must never import torch. Every checkpoint served by vLLM ships a
`tokenizer.json`, which is all the fast class needs.

Encoding goes straight to the Rust backend (`backend_tokenizer`), which is thread-safe;
prompts longer than `THREAD_THRESHOLD_CHARS` are encoded in a worker thread so a huge prompt
does not stall the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread

from router.errors import InvalidRequest

__all__ = ["THREAD_THRESHOLD_CHARS", "PromptTokenizer", "load_tokenizer"]

THREAD_THRESHOLD_CHARS = 2000
# HF uses a huge sentinel (int(1e30)) for "no limit" in model_max_length.
_NO_LIMIT = 10**8


class PromptTokenizer:
    """Counts prompt tokens for completions and chat. Methods are called on the event loop.

    `max_model_len` is the context length in tokens, or None when unknown.
    """

    def __init__(self, hf_tokenizer: Any, max_model_len: int | None) -> None:
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        self.max_model_len = max_model_len

    async def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt, special tokens (e.g. BOS) added as the engine
        would add them."""
        return await self._run(len(text), self._encode, text, True)

    async def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of `messages` rendered with the chat template. A template error (e.g. a
        role the template rejects) is the client's fault: `InvalidRequest`."""
        size = sum(len(str(m.get("content") or "")) for m in messages)
        return await self._run(
            size, self._encode_chat, messages, add_generation_prompt, dict(template_kwargs or {})
        )

    def _encode(self, text: str, special: bool) -> list[int]:
        ids: list[int] = self._backend.encode(text, add_special_tokens=special).ids
        return ids

    def _encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_gen: bool, kwargs: dict[str, Any]
    ) -> list[int]:
        try:
            text = self._hf.apply_chat_template(
                [_flatten_message(m) for m in messages],
                add_generation_prompt=add_gen,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:  # jinja/template errors carry the useful message
            raise InvalidRequest(f"cannot apply chat template: {exc}", param="messages") from None
        # The template already wrote BOS and friends; adding them again would double them.
        return self._encode(str(text), False)

    async def _run(self, size: int, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        if size <= THREAD_THRESHOLD_CHARS:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args)


def _flatten_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Templates expect string content: join the text parts of a multi-part content list."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return {**message, "content": "\n".join(str(t) for t in texts)}


def load_tokenizer(source: str, model: str, max_model_len: int | None) -> PromptTokenizer:
    """Load the tokenizer from a local directory or hub name (blocking; call at startup).

    The context length is `max_model_len` if given, else the model's `config.json`
    (`max_position_embeddings`) when `model` is a local directory, else the tokenizer's
    `model_max_length`, else unknown.
    """
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(source)
    limit = max_model_len or _model_config_limit(model) or _tokenizer_limit(hf)
    return PromptTokenizer(hf, limit)


def _model_config_limit(model: str) -> int | None:
    path = Path(model) / "config.json"
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _tokenizer_limit(hf: Any) -> int | None:
    value = getattr(hf, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < _NO_LIMIT else None
