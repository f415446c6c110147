"""One client request through pdgate: tokenize → decide → `flows[mode].run`.

`tokenize` counts the prompt's tokens and checks the context length (only when a policy,
the decider or the flow needs the tokens: `tokenize_prompts`); the decider says
whether to disaggregate; the flow of `--pd-mode` (router/flows/) runs the legs. A request
the decider keeps on one engine is served by the pull flow; one the notify/push flow cannot
run (no healthy prefill engine, an engine that cannot run that mode) too, from inside that
flow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdgate.router import request_context
from pdgate.router.errors import ContextLengthExceeded
from pdgate.router.flows.base import Flow, StreamResult
from pdgate.router.flows.migration import MigrationMetrics, Migrator
from pdgate.router.flows.pull import PullFlow
from pdgate.router.input.limits import InputLimits
from pdgate.router.input.schema import ChatParams, ClientRequest
from pdgate.router.input.tokenization import PromptTokenizer, check_chat
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies.decider import Decider, Decision, PrefixDecider, decide
from pdgate.router.tracing import span

__all__ = ["Decision", "MigrationSettings", "Orchestrator", "StreamResult",
           "check_context_length", "decide"]


class Orchestrator:
    """Runs one client request through the engines. Built once per app; no framework."""

    def __init__(self, tokenizer: PromptTokenizer | None, metrics: RouterMetrics,
                 pull: PullFlow, pd_flow: Flow | None = None, decider: Decider | None = None,
                 *, tokenize_prompts: bool = True, limits: InputLimits | None = None,
                 migration: MigrationSettings | None = None) -> None:
        if tokenize_prompts and tokenizer is None:
            raise ValueError("tokenize_prompts needs a tokenizer")
        self.tokenizer = tokenizer
        # False when no policy, decider rule or flow reads the prompt's tokens: the router
        # then never tokenizes (its cost grows with the prompt) and the engines check the
        # context length themselves (their 400 is relayed as is). The tokenizer may then
        # be None: the chat rules below need only the limits.
        self.tokenize_prompts = tokenize_prompts
        self.limits = limits or (tokenizer.limits if tokenizer is not None else InputLimits())
        self.metrics = metrics
        self.decider: Decider = decider or PrefixDecider()
        self.pull = pull
        self.pd_flow: Flow = pd_flow or pull  # the flow of `--pd-mode`
        self.migrator = migration.migrator(self) if migration is not None else None

    async def handle(self, req: ClientRequest) -> bytes | StreamResult:
        """Run `req`: JSON body bytes for a non-streaming answer, else a `StreamResult`.
        A non-streaming answer's tokens are counted here, from the body the client gets;
        a stream counts its own as it is relayed (router/flows/common.py `relay_chunks`)."""
        result = await self._serve(req)
        # A non-streaming answer the router assembled from a tracked stream (migration)
        # was counted by that stream's relay.
        if isinstance(result, bytes) and not req.track_ids:
            self.metrics.observe_answer(result)
        return result

    async def _serve(self, req: ClientRequest) -> bytes | StreamResult:
        if self.tokenize_prompts:
            with span("tokenize"):
                await self.tokenize(req)
        elif isinstance(req.params, ChatParams):
            check_chat(self.limits, req.body["messages"], req.params.chat_template_kwargs,
                       req.params.chat_template)
        decision = self.decider.decide(req)
        self.metrics.child(self.metrics.disagg_decisions, decision.reason).inc()
        # TTFT counts from the request's arrival (admission queue and tokenization included),
        # as the client sees it.
        record = request_context.current()
        if record is not None:
            record.decision = decision.reason
        t0 = record.arrival if record is not None else time.perf_counter()
        if self.migrator is None:
            return await self._run(req, t0, decision.disagg)
        # A stream that may migrate asks its decode legs for token ids (router/flows/
        # migration.py); its continuations run through `continue_stream`.
        why_not = self.migrator.prepare(req)
        if why_not is None and not req.stream:
            # Served as a stream the router reads, so that it may migrate too.
            return await self.migrator.answer(
                req, lambda inner: self._run(inner, t0, decision.disagg))
        return self.migrator.wrap(req, await self._run(req, t0, decision.disagg), why_not)

    async def _run(self, req: ClientRequest, t0: float, disagg: bool) -> bytes | StreamResult:
        if not disagg:
            return await self.pull.direct(req, t0)
        # A request the mode cannot run here is served by the pull flow, inside the flow.
        return await self.pd_flow.run(req, t0)

    async def continue_stream(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        """A migrated stream's continuation: always a new P/D attempt (decode-only, counted,
        when no prefill engine is healthy)."""
        return await self.pd_flow.run(req, t0)

    async def tokenize(self, req: ClientRequest) -> None:
        """Fill `req.prompt_token_ids` (single prompts) and enforce the context length.

        A prompt whose length in characters already proves it cannot fit is refused before
        it is tokenized (or, for chat, before the template renders all of it)."""
        tok = self.tokenizer
        assert tok is not None  # __init__: tokenize_prompts comes with a tokenizer
        char_limit = tok.char_limit(req.max_tokens)
        if isinstance(req.params, ChatParams):
            text = await tok.render_chat(
                req.body["messages"], add_generation_prompt=req.params.add_generation_prompt,
                template_kwargs=req.params.chat_template_kwargs,
                chat_template=req.params.chat_template, stop_after=char_limit,
            )
            special = False  # the template wrote BOS and friends
        elif isinstance(req.prompt, str):
            text, special = req.prompt, True
        elif req.prompt is not None:
            req.prompt_token_ids = req.prompt
            check_context_length(len(req.prompt), req.max_tokens, tok.max_model_len)
            return
        else:
            return  # batch prompts: each entry is checked by the engine
        if char_limit is not None and len(text) > char_limit:
            check_context_length(tok.min_tokens(len(text)), req.max_tokens,
                                 tok.max_model_len, at_least=True)
        ids = await tok.encode_text(text, add_special_tokens=special)
        req.prompt_token_ids = ids
        check_context_length(len(ids), req.max_tokens, tok.max_model_len)


@dataclass(frozen=True)
class MigrationSettings:
    """Mid-stream migration's settings (`--max-migrations`, `--migration-deadline-s`,
    `--migrate-non-streaming`), the `--pd-mode` it labels its metrics with, and those
    metrics."""

    metrics: MigrationMetrics
    mode: str
    max_migrations: int = 2
    deadline_s: float = 30.0
    non_streaming: bool = False

    def migrator(self, orch: Orchestrator) -> Migrator:
        """The orchestrator's migrator: continuations run through its P/D flow, prompts
        are tokenized with its tokenizer (none: nothing migrates)."""
        tok = orch.tokenizer
        return Migrator(orch.continue_stream, orch.tokenize if tok is not None else None,
                        self.metrics, self.mode, max_migrations=self.max_migrations,
                        deadline_s=self.deadline_s,
                        max_model_len=tok.max_model_len if tok is not None else None,
                        non_streaming=self.non_streaming)


def check_context_length(prompt_tokens: int, max_tokens: int | None, limit: int | None,
                         *, at_least: bool = False) -> None:
    """Raise `ContextLengthExceeded` when the prompt plus the requested completion (at
    least one token) does not fit `limit` tokens. No check when the limit is unknown.
    `at_least`: `prompt_tokens` is a lower bound (the prompt was not tokenized)."""
    if limit is None:
        return
    wanted = prompt_tokens + (max_tokens or 1)
    if wanted > limit:
        some = "at least " if at_least else ""
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{some}{wanted} tokens ({some}{prompt_tokens} in the prompt, {max_tokens or 1} "
            "for the completion). Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if max_tokens else "prompt",
        )
