"""Selective disaggregation: should this request go through a prefill engine at all?

A decider answers once per request, after tokenization and before any engine is picked;
the orchestrator counts every answer in `pdgate_disagg_decisions_total{reason}`. Reasons:

| reason            | disagg | when                                                        |
|-------------------|--------|-------------------------------------------------------------|
| `n_gt_1`          | no     | `n > 1` (one set of P blocks cannot feed several children)  |
| `batch_prompt`    | no     | a list of several prompts                                   |
| `prompt_logprobs` | no     | `prompt_logprobs`, or `echo` with `logprobs`: the prompt's  |
|                   |        | logprobs come only from an engine that computes the prompt  |
| `short_prompt`    | no     | fewer prompt tokens than `--disagg-min-tokens`              |
| `decode_has_prefix` | no   | a healthy decode engine already holds at least             |
|                   |        | `--disagg-prefix-ratio` of the prompt (prefix index)        |
| `colocated`       | no     | the model is served colocated (`pd_mode: colocated`)       |
| `disagg`          | yes    | otherwise                                                   |

Running on D alone is never wrong, only slower for long uncached prompts: D computes the
prompt itself. The prefix rule pays off when the decode policy is prefix-aware (or
kv-events), so that the direct request lands on the engine holding the prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from pdgate.router.input.schema import ClientRequest

__all__ = ["Decider", "Decision", "DecodePrefixLookup", "PrefixDecider", "decide"]


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether to disaggregate, and why (the `reason` label of the decisions metric)."""

    disagg: bool
    reason: str


class Decider(Protocol):
    """Decides per request; called on the event loop, must not block. Deciders are
    configured by `--decider` (router/policies/setup.py: `build_decider`): `static`
    (`PrefixDecider`) or `measured-cost` (router/policies/measured_cost.py)."""

    @property
    def needs_tokens(self) -> bool:
        """Whether `decide` reads the prompt's tokens (the router then tokenizes)."""
        ...

    @property
    def reads_engine_load(self) -> bool:
        """Whether `decide` reads engines' own load (the app then polls their /metrics)."""
        ...

    def decide(self, req: ClientRequest) -> Decision:
        """The decision for a tokenized request (`req.prompt_token_ids` set for single
        prompts)."""
        ...


def decide(req: ClientRequest) -> Decision:
    """The rules every decider applies first: `n > 1` and batch prompts go straight to a
    decode engine (one set of P blocks must never be shared by several decode children),
    and so do requests for the prompt's logprobs (D loads the prompt's KV instead of
    computing the prompt, so it has none to give; vLLM 0.32's P stalled on them)."""
    if req.n > 1:
        return Decision(False, "n_gt_1")
    if req.batch:
        return Decision(False, "batch_prompt")
    body = req.body
    if body.get("prompt_logprobs") or (body.get("echo") and body.get("logprobs")):
        return Decision(False, "prompt_logprobs")
    return Decision(True, "disagg")


# (prompt token ids) -> the largest number of leading prompt tokens a healthy decode
# engine is believed to hold.
DecodePrefixLookup = Callable[[Sequence[int]], int]


_COLOCATED = Decision(False, "colocated")


class PrefixDecider:
    """`decide` plus the short-prompt and decode-holds-the-prefix rules (module docstring):
    the `static` decider. `min_tokens` 0 disables the length rule; `prefix_ratio` None (or
    no `lookup`) disables the prefix rule. `colocated`: the model has no prefill pool,
    every answer is no."""

    type: ClassVar[str] = "static"
    reads_engine_load: ClassVar[bool] = False

    def __init__(
        self,
        min_tokens: int = 0,
        prefix_ratio: float | None = None,
        lookup: DecodePrefixLookup | None = None,
        *, colocated: bool = False,
    ) -> None:
        self.colocated = colocated
        self.min_tokens = min_tokens
        self.prefix_ratio = prefix_ratio
        self.lookup = lookup

    @property
    def needs_tokens(self) -> bool:
        """Whether a rule reads the prompt's tokens (the length or the prefix rule is on)."""
        return self.min_tokens > 0 or (self.prefix_ratio is not None and self.lookup is not None)

    def decide(self, req: ClientRequest) -> Decision:
        if self.colocated:
            return _COLOCATED
        base = decide(req)
        ids = req.prompt_token_ids
        if not base.disagg or ids is None:
            return base
        if len(ids) < self.min_tokens:
            return Decision(False, "short_prompt")
        if self.prefix_ratio is not None and self.lookup is not None and ids:
            if self.lookup(ids) >= self.prefix_ratio * len(ids):
                return Decision(False, "decode_has_prefix")
        return base
