"""Per-leg endpoint selection: candidates -> weighted scorers clamped to [0, 1] -> a picker.

One `Policy` Protocol (`base.py`), one module per policy, a read-only registry
(`registry.py`), and the runner that filters, scores, picks and records (`runner.py`).

| type             | picks                                                                |
|------------------|----------------------------------------------------------------------|
| `round-robin`    | the next candidate in turn                                           |
| `least-inflight` | fewest requests in flight; ties rotate                               |
| `power-of-two`   | the less loaded of two random candidates                             |
| `random`         | a random candidate                                                   |
| `session`        | the engine that served the session (header or `user`) before         |
| `consistent-hash`| the session key's engine on a hash ring (the same on every replica)  |
| `prefix-aware`   | the longest cached prefix (router's own index), unless load is skewed |
| `prefix-text`    | `prefix-aware` on the prompt's characters (no tokenizer)             |
| `kv-events`      | like `prefix-aware`, from engines' KV cache events where published    |
| `load-aware`     | the least load, counting each engine's own queue and KV usage         |
"""

from __future__ import annotations

from pdgate.router.policies.base import PickContext, Policy, PolicyEnv, Scorer
from pdgate.router.policies.registry import (
    ALIASES,
    POLICIES,
    POLICY_NAMES,
    build_policy,
    check_policy,
    policy_spec,
)
from pdgate.router.policies.runner import Selector, choose

__all__ = [
    "ALIASES",
    "POLICIES",
    "POLICY_NAMES",
    "PickContext",
    "Policy",
    "PolicyEnv",
    "Scorer",
    "Selector",
    "build_policy",
    "check_policy",
    "choose",
    "policy_spec",
]
