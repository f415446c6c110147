"""The policy contract: what a policy sees (`PickContext`, `PolicyEnv`), what it implements
(`Policy`, `Scorer`), and how it reads its params (`parse_params`).

A policy is a small class with a kebab-case `type`, a frozen `Params` struct (every field has
a default) and two parts the runner (`router.policies.runner`) drives:
`scorers` (weighted `Scorer`s whose outputs the runner clamps to [0, 1] and sums) and an
async `pick` that chooses one candidate given those totals. Policies never see an empty or
unhealthy candidate list and never raise `NoEndpointAvailable`: the runner does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import msgspec

from pdgate.router.adapters import AdapterNeed
from pdgate.router.config import ConfigError
from pdgate.router.input.schema import ClientRequest
from pdgate.router.policies.kv_events import KVEventIndex
from pdgate.router.policies.prefix_index import (
    PrefixIndex,
    block_hashes,
    lora_root,
    text_block_hashes,
)
from pdgate.router.pool import Endpoint

__all__ = [
    "PickContext",
    "Policy",
    "PolicyEnv",
    "Scorer",
    "NoParams",
    "ParamsType",
    "least_loaded",
    "parse_params",
]

P = TypeVar("P", bound=msgspec.Struct)
_json_text = msgspec.json.Encoder().encode
ParamsType = type[msgspec.Struct]  # (`type` is shadowed inside policy classes)


@dataclass(frozen=True)
class PickContext:
    """What a policy may look at besides the endpoints, built once per request (and reused
    by a retry). `prompt_token_ids` is None for batch prompts; `headers` are the client's
    request headers (case-insensitive mapping); `user` is the OpenAI `user` field."""

    request_id: str
    prompt_token_ids: Sequence[int] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    # The prompt as text, for the `prefix-text` policy: a completion's single string
    # prompt, or a chat's messages (rendered by `prompt_text` only when asked for).
    prompt: str | None = None
    messages: Any = None
    # The request's LoRA adapter (None: the base model): the runner keeps only engines
    # holding it, and the prompt's block hashes are keyed by it (`lora_root`).
    adapter: AdapterNeed | None = None
    # Engine URLs that failed this request mid-stream (a migration's continuation): the
    # runner skips them while another candidate is left. A dying engine may still accept
    # connections for a while and never answer; the pool learns that only later.
    avoid: frozenset[str] = frozenset()
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, req: ClientRequest) -> PickContext:
        """The context of a validated client request: built once per request (after its
        prompt was tokenized, when it is), then reused by every leg and retry."""
        found = req.pick_context
        if isinstance(found, PickContext):
            return found
        user = req.body.get("user")
        prompt = req.prompt if isinstance(req.prompt, str) else None
        ctx = req.pick_context = cls(
            req.request_id, req.prompt_token_ids, req.client_headers,
            user if isinstance(user, str) else None, prompt,
            req.body.get("messages") if req.kind == "chat" else None, req.adapter)
        return ctx

    def prompt_text(self) -> str | None:
        """The prompt's text (a chat's messages as `role: content` lines), or None for
        batch and token-id prompts."""
        if self.prompt is not None or not isinstance(self.messages, list):
            return self.prompt
        lines = []
        for m in self.messages:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else _json_text(content).decode()
                lines.append(f"{m.get('role')}: {text}")
        return "\n".join(lines)

    def text_hashes(self, block_chars: int) -> list[int]:
        """Chained hashes of the prompt text's full `block_chars`-character blocks
        (computed once per size; empty without a text prompt)."""
        found = self._hashes.get(-block_chars)  # negative keys: text, positive: tokens
        if found is None:
            text = self.prompt_text()
            found = [] if text is None else text_block_hashes(text, block_chars,
                                                              self._root())
            self._hashes[-block_chars] = found
        return found

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks (computed once per block size)."""
        if self.prompt_token_ids is None:
            return []
        found = self._hashes.get(block_size)
        if found is None:
            found = self._hashes[block_size] = block_hashes(self.prompt_token_ids, block_size,
                                                            self._root())
        return found

    def _root(self) -> int:
        """The first block's parent: the base model's, or the adapter's own."""
        return lora_root(None if self.adapter is None else self.adapter.name)


@dataclass(frozen=True)
class PolicyEnv:
    """Shared state policies may read, built once per app. `approx` is the router-local
    index of routing decisions (every pick records the prompt's blocks on the chosen
    engine); `exact` is the index fed by engines' KV events (None without `--kv-events`).
    `block_size` is the engines' KV block size in tokens. Both indexes are keyed by
    endpoint key (`Endpoint.key`: the engine's base URL, or `url@rank` for a DP rank)."""

    block_size: int = 16
    approx: PrefixIndex = field(default_factory=lambda: PrefixIndex(1 << 20))
    exact: KVEventIndex | None = None
    clock: Callable[[], float] | None = None
    # The most recent routing decisions only: with KV events, a prompt routed a moment ago
    # is not in the engine's events yet (its prefill is still running), so a burst of one
    # prefix would scatter; these recent entries bridge that gap.
    recent: PrefixIndex = field(default_factory=lambda: PrefixIndex(4096))
    # The `prefix-text` policy's block, in characters: about 64 tokens of English text
    # (4 engine blocks). Routing needs no finer grain, and each block costs a hash and an
    # index entry per request.
    block_chars: int = 256

    def matched_blocks(
        self, hashes: Sequence[int], engines: Sequence[str], *, use_events: bool
    ) -> dict[str, int]:
        """Leading blocks of `hashes` each engine holds: from its KV events when
        `use_events` and the engine publishes, else from the approximate index."""
        exact = self.exact
        if not use_events or exact is None:
            return self.approx.match(hashes, engines)
        publishing = [e for e in engines if exact.publishes(e)]
        silent = [e for e in engines if not exact.publishes(e)]
        out: dict[str, int] = {}
        if publishing:
            out = exact.index.match(hashes, publishing)
            for e, n in self.recent.match(hashes, publishing).items():
                out[e] = max(out[e], n)
        if silent:
            out.update(self.approx.match(hashes, silent))
        return out


class Scorer(Protocol):
    """Scores candidates for one request; higher is better. Values outside [0, 1] are
    clamped by the runner. Must not block (called on the event loop)."""

    name: ClassVar[str]
    # Whether `score` reads the prompt's tokens (`ctx.block_hashes`): the router tokenizes
    # prompts only when some scorer, the decider or the flow needs them.
    needs_tokens: ClassVar[bool]
    # Whether `score` reads the prompt's text blocks (`ctx.text_hashes`) instead: the
    # runner then records text blocks, not token blocks, on the chosen engine.
    reads_text: ClassVar[bool]

    def score(self, candidates: Sequence[Endpoint], ctx: PickContext) -> list[float]:
        """One score per candidate, in order."""
        ...


class Policy(Protocol):
    """A registered routing policy (see the module docstring)."""

    type: ClassVar[str]
    Params: ClassVar[ParamsType]

    @property
    def scorers(self) -> Sequence[tuple[Scorer, float]]:
        """(scorer, weight) pairs the runner evaluates before `pick` (may be empty)."""
        ...

    async def pick(
        self, candidates: Sequence[Endpoint], scores: Sequence[float], ctx: PickContext
    ) -> Endpoint:
        """Return one of `candidates` (never empty, all healthy); `scores[i]` is candidate
        i's weighted score sum. May update the policy's own state. Must not block."""
        ...


def parse_params(policy: str, params: Mapping[str, Any], typ: type[P]) -> P:
    """Strictly decode `params` into `typ`; `ConfigError` names the policy and the field."""
    try:
        return msgspec.convert(dict(params), typ)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"policy {policy!r}: params: {exc}") from None


def least_loaded(candidates: Sequence[Endpoint], turn: int) -> Endpoint:
    """The candidate with the fewest requests in flight; ties broken by `turn` (rotation)."""
    least = min(ep.in_flight for ep in candidates)
    tied = [ep for ep in candidates if ep.in_flight == least]
    return tied[turn % len(tied)]


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Params of a policy without settings: only an empty mapping is accepted."""
