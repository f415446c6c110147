"""`prefix-text`: `prefix-aware` on the prompt's text instead of its tokens (no tokenizer).

The prompt (a completion's string, a chat's messages as `role: content` lines) is cut into
blocks of `block_chars` characters (PolicyEnv, 256 by default: about four 16-token KV blocks
of English text) with chained hashes, the way vllm-router's `cache_aware` policy matches
characters. Tokenizing a long prompt costs the router more CPU than routing it; character
blocks cost one hash per block. The index is the router's own record of where it sent each
prompt (approximate, like `prefix-aware`'s); token-id prompts and batches score 0 (load and
spread still apply). Scorers, weights, balance check and picker are `prefix-aware`'s:

| param                   | default | meaning                                             |
|-------------------------|---------|-----------------------------------------------------|
| `prefix_weight`         | 1.0     | weight of the matched-prefix fraction (text blocks) |
| `load_weight`           | 0.1     | weight of 1 / (1 + in flight)                       |
| `spread_weight`         | 0.01    | weight of "holds fewer cached blocks"               |
| `balance_abs_threshold` | 8       | in-flight difference that may count as imbalance    |
| `balance_rel_threshold` | 1.5     | max / min in-flight ratio that may count as one     |
"""

from __future__ import annotations

from typing import ClassVar

from pdgate.router.policies.base import ParamsType, PolicyEnv, Scorer
from pdgate.router.policies.prefix_aware import PrefixAware, PrefixAwareParams
from pdgate.router.policies.scorers import LoadScorer, SpreadScorer, TextPrefixScorer

__all__ = ["PrefixText"]


class PrefixText(PrefixAware):
    """See the module docstring."""

    type: ClassVar[str] = "prefix-text"
    Params: ClassVar[ParamsType] = PrefixAwareParams

    def __init__(self, params: PrefixAwareParams, env: PolicyEnv) -> None:
        super().__init__(params, env)
        self._scorers: tuple[tuple[Scorer, float], ...] = (
            (TextPrefixScorer(env), params.prefix_weight),
            (LoadScorer(), params.load_weight),
            (SpreadScorer(env), params.spread_weight),
        )
