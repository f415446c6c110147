"""Which prompts are too long by their length alone, before anyone tokenizes them.

Tokenizing a multi-megabyte prompt costs seconds and about 250 times its size in memory;
the router and the shim both refuse such a prompt early when its character count proves it
cannot fit. The bound: the most input characters one token of a tokenizer can cover (its
longest vocabulary entry, added tokens included, times what its normalizer can shrink text
by), scanned once at load. A prompt of `chars` characters is then at least
`ceil(chars / max_chars_per_token)` tokens. A tokenizer whose pipeline can drop or merge
characters without bound has no such bound (None): its prompts are always tokenized.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["char_limit", "max_chars_per_token", "min_tokens"]

# NFC/NFKC can merge a canonical decomposition back into one character: at most 4 code
# points (e.g. U+1F82), checked against unicodedata in the tests.
_NFC_MAX_MERGE = 4
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts",
                           "FixedLength")


def char_limit(max_model_len: int | None, max_tokens: int | None,
               chars_per_token: int | None) -> int | None:
    """The most characters a prompt may have and still fit `max_model_len` tokens with
    `max_tokens` (None: at least one) to generate; None when there is no bound."""
    if max_model_len is None or chars_per_token is None:
        return None
    return max(0, max_model_len - (max_tokens or 1)) * chars_per_token


def min_tokens(chars: int, chars_per_token: int) -> int:
    """The fewest tokens `chars` characters of text can be."""
    return math.ceil(chars / chars_per_token)


def max_chars_per_token(backend: Any) -> int | None:
    """The most input characters one token of `backend` (a `tokenizers.Tokenizer`) can
    cover: its longest vocabulary entry (added tokens included) times what the normalizer
    can shrink text by. None when the pipeline can drop or merge characters without bound
    (e.g. a whitespace-removing pre-tokenizer, WordPiece's one [UNK] for any long word)."""
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if (shrink is None or not _keeps_chars(spec.get("pre_tokenizer"))
            or not _bounded_model(spec.get("model") or {})):
        return None
    longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)
    return max(longest, 1) * shrink


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1
        for part in spec.get("normalizers", []):
            factor = _normalizer_shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return 1  # these never shorten text
    if kind in ("NFC", "NFKC"):
        return _NFC_MAX_MERGE
    if kind == "Replace":
        old, new = (spec.get("pattern") or {}).get("String"), spec.get("content", "")
        if isinstance(old, str) and isinstance(new, str) and new:
            return max(1, math.ceil(len(old) / len(new)))
    return None  # strips, removes or rewrites by regex: no bound


def _keeps_chars(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_chars(p) for p in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return str(spec.get("behavior", "")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _bounded_model(spec: dict[str, Any]) -> bool:
    kind = spec.get("type")
    if kind == "BPE":  # fused unknowns make one token of any run of unknown characters
        return not (spec.get("unk_token") and spec.get("fuse_unk")
                    and not spec.get("byte_fallback"))
    if kind == "Unigram":  # fuses unknowns unless it falls back to bytes
        return spec.get("unk_id") is None or bool(spec.get("byte_fallback"))
    return False  # WordPiece, WordLevel: an unknown word of any length is one token
