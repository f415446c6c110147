"""Mid-stream migration: a decode engine that fails after the client's first byte (reset,
error event, idle timeout, open breaker) does not end the client's stream; a new P/D
attempt continues it where the client is.

Every migratable stream (`Migrator.prepare`; router/flows/resume.py says which are) asks its
decode legs for `return_token_ids` on the router's behalf; `MigratingStream` reads the
relayed events (router/engines/resume_events.py: ids removed, the error event held back).
When a leg fails before its finish, the continuation is a completion whose prompt is the
original prompt's ids plus the tokens the client has text for, with what is left of the
budget, run through the flow of `--pd-mode` like any request: P prefills the whole prefix
and its KV moves to another decode engine (the failed one is avoided: a dying engine may
still accept connections and never answer), or,
with no healthy P, a decode engine computes it (counted as `recompute`). The early first
token of the continuation, its retries before the first byte, and its KV cleanup are the
flows' own. The client sees one stream: the same id, one usage block, one `[DONE]`.

With `--migrate-non-streaming`, a non-streaming request that may migrate runs the same way,
as a stream the router reads itself (`Migrator.answer`); its chunks become the one JSON
answer the client asked for (router/engines/stream_answer.py).

Bounded: at most `--max-migrations` continuations per request, each opened within
`--migration-deadline-s` of the failure. Visible: `pdgate_migrations_total{mode,result}`
(kv, recompute, failed, limit, deadline), `pdgate_migrations_declined_total{reason}` (a
non-migratable stream that failed mid-response), the resume gap
`pdgate_migration_resume_gap_seconds{mode}` (failure to the continuation's first byte
relayed), a `migration` span per continuation and `migrations` on the access line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdgate.router import request_context
from pdgate.router.dp_ranks import split_key
from pdgate.router.engines.resume_events import ResumeEvents
from pdgate.router.engines.stream_answer import StreamAnswer
from pdgate.router.errors import RouterError
from pdgate.router.flows.base import StreamResult
from pdgate.router.flows.resume import (
    continuation_body,
    declined,
    greedy,
    remaining_budget,
    stop_rule,
)
from pdgate.router.input.schema import ClientRequest, CompletionParams, StreamOptions
from pdgate.router.policies import PickContext
from pdgate.router.tracing import span

__all__ = ["MigrationMetrics", "Migrator", "MigratingStream"]

log = logging.getLogger(__name__)
_ERROR_EVENT = b'data: {"error"'
OFF = "off"  # `prepare`'s verdict for a request migration does not look at (not counted)

Runner = Callable[[ClientRequest, float], Awaitable[bytes | StreamResult]]


@dataclass(frozen=True)
class MigrationMetrics:
    """Migration's metrics, on the app's registry."""

    migrations: Counter  # mode, result
    declined: Counter  # reason
    resume_gap: Histogram  # mode

    @classmethod
    def create(cls, registry: CollectorRegistry) -> MigrationMetrics:
        return cls(
            migrations=Counter(
                "pdgate_migrations",
                "Continuations of streams whose decode engine failed mid-response, by how "
                "they went (kv: P's KV moved to the new decode engine; recompute: a decode "
                "engine computed the prefix; failed: the continuation could not open; "
                "limit: --max-migrations reached; deadline: --migration-deadline-s passed)",
                ["mode", "result"], registry=registry),
            declined=Counter(
                "pdgate_migrations_declined",
                "Streams that failed mid-response and could not be migrated, by reason",
                ["reason"], registry=registry),
            resume_gap=Histogram(
                "pdgate_migration_resume_gap_seconds",
                "Decode failure to the continuation's first byte relayed to the client",
                ["mode"], registry=registry,
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)),
        )


class Migrator:
    """Decides which streams may migrate and wraps them (built once per app). `run` serves
    a continuation (the flow of `--pd-mode`); `tokenize` fills a request's prompt ids (None:
    the router has no tokenizer, so nothing migrates); `non_streaming`: non-streaming
    requests may migrate too (`answer`)."""

    def __init__(self, run: Runner, tokenize: Callable[[ClientRequest], Awaitable[None]] | None,
                 metrics: MigrationMetrics, mode: str, *, max_migrations: int,
                 deadline_s: float, max_model_len: int | None,
                 non_streaming: bool = False) -> None:
        self.run = run
        self.tokenize = tokenize
        self.metrics = metrics
        self.mode = mode
        self.max_migrations = max_migrations
        self.deadline_s = deadline_s
        self.max_model_len = max_model_len
        self.non_streaming = non_streaming

    def prepare(self, req: ClientRequest) -> str | None:
        """Before the flow runs: None when `req` may migrate (its legs then ask for token
        ids; a non-streaming one is then served by `answer`), else why not (`OFF`:
        migration is off, or a non-streaming request that may not or cannot migrate: it
        keeps the plain non-streaming legs)."""
        if self.max_migrations <= 0 or not (req.stream or self.non_streaming):
            return OFF
        if not req.stream and req.body.get("stream_options") is not None:
            return OFF  # the engine's to refuse (stream options without a stream)
        reason = "no_tokenizer" if self.tokenize is None else declined(req, self.max_model_len)
        if reason is None:
            req.track_ids = True
        elif not req.stream:
            return OFF
        return reason

    async def answer(self, req: ClientRequest,
                     run: Callable[[ClientRequest], Awaitable[bytes | StreamResult]]) -> bytes:
        """A migratable non-streaming request (`prepare` said None): `run` serves it as a
        stream the router reads itself, migrated like a client's stream when its decode
        engine fails mid-generation, and assembled into the one JSON answer the client
        asked for (router/engines/stream_answer.py). A failure no continuation could
        repair raises the decode leg's error (502/504), as a non-streaming leg's would;
        one the router could not continue because the engine listed no token ids is
        served again from the start, plainly, as it would have been without migration
        (the client has seen nothing yet)."""
        inner = _as_stream(req)
        result = await run(inner)
        if not isinstance(result, StreamResult):
            return result
        stream = MigratingStream(self, inner, result)
        answer = StreamAnswer(req.kind == "chat")
        chunks = stream.chunks()
        try:
            async for piece in chunks:
                answer.feed(piece)
        finally:
            await chunks.aclose()
            stream.close()
        if answer.error is not None and stream.untracked:
            req.track_ids = False  # the plain answer is the engine's, counted as such
            plain = await run(req)
            if isinstance(plain, bytes):
                return plain
            plain.close()
        return answer.body()

    def wrap(self, req: ClientRequest, result: bytes | StreamResult, reason: str | None
             ) -> bytes | StreamResult:
        """The client's answer: a migrating stream, or `result` watched for failures that
        cannot migrate (counted by `reason`)."""
        if not isinstance(result, StreamResult) or reason == OFF:
            return result
        if reason is not None:
            return StreamResult(self._watch(result.chunks, reason), result.close)
        stream = MigratingStream(self, req, result)
        return StreamResult(stream.chunks(), stream.close)

    async def _watch(self, chunks: AsyncIterator[bytes], reason: str
                     ) -> AsyncGenerator[bytes, None]:
        async for piece in chunks:
            if _ERROR_EVENT in piece:
                self.metrics.declined.labels(reason).inc()
            yield piece


class MigratingStream:
    """One client stream across its legs (see the module doc); `close()` closes whichever
    leg is open (idempotent)."""

    def __init__(self, migrator: Migrator, req: ClientRequest, first: StreamResult) -> None:
        self._m = migrator
        self._req = req
        self._leg: StreamResult | None = first
        self._events = ResumeEvents(req.kind == "chat", req.wants_usage_chunks,
                                    stop_rule(req), exact=greedy(req))
        self._count = 0
        self._record = request_context.current()
        self._served = req.served_by  # the open leg's engines
        self._avoid: frozenset[str] = frozenset()  # decode engines that failed this stream

    @property
    def untracked(self) -> bool:
        """A leg's chunks listed no token ids (see `ResumeEvents.untracked`)."""
        return self._events.untracked

    def close(self) -> None:
        leg, self._leg = self._leg, None
        if leg is not None:
            leg.close()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        ev = self._events
        failed_at: float | None = None
        while self._leg is not None:
            leg = self._leg
            async for piece in leg.chunks:
                out = ev.feed(piece)
                if out:
                    if failed_at is not None:
                        self._m.metrics.resume_gap.labels(self._m.mode).observe(
                            time.perf_counter() - failed_at)
                        failed_at = None
                    yield out
                if ev.stopped:
                    break
            if ev.stopped:  # at a stop string its engine did not see across the cut
                log.warning("request %s: stop string %r across the cut of continuation "
                            "%d; the stream ends there", self._req.request_id,
                            ev.text.stop, self._count)
                await leg.chunks.aclose()
                self.close()
                break
            if ev.failure is None or ev.finished is not None:
                break
            if ev.untracked:
                self._m.metrics.declined.labels("no_token_ids").inc()
                break
            failed_at = time.perf_counter()
            self._note_failed_decode()
            if not await self._resume(failed_at):
                break
        if ev.wants_usage and (ev.stopped or ev.failure is not None
                               and ev.finished is not None):
            # The answer was whole; its usage chunk was lost with the engine, or the leg
            # was closed at a stop string it did not see.
            await self._prompt_ids()
            ev.bill_prompt(len(self._req.prompt_token_ids or ()))
            yield ev.usage_event()
        yield ev.end()

    def _note_failed_decode(self) -> None:
        """The failed leg's decode engine is avoided by every continuation of this stream
        (all its DP ranks: one process), while another is healthy."""
        key = self._served.get("decode")
        if key is not None:
            self._avoid |= {split_key(key)[0]}

    async def _prompt_ids(self) -> list[int]:
        req, tokenize = self._req, self._m.tokenize
        if req.prompt_token_ids is None:
            assert tokenize is not None  # `prepare` let only tokenizable requests through
            await tokenize(req)
        return list(req.prompt_token_ids or ())

    async def _resume(self, failed_at: float) -> bool:
        """Open a continuation in place of the failed leg; False when none may or could
        open (the client then gets the leg's error event)."""
        self.close()
        deadline = failed_at + self._m.deadline_s
        ttft = self._record.ttft_s if self._record is not None else None
        while True:
            result = self._give_up(deadline)
            if result is not None:
                self._count_result(result)
                return False
            self._count += 1
            try:
                with span("migration", **{"pdgate.migration": self._count}):
                    async with asyncio.timeout(deadline - time.perf_counter()):
                        self._leg, label = await self._open(failed_at)
            except (RouterError, TimeoutError) as exc:
                self._note_failed_decode()
                self._count_result("failed")
                log.warning("request %s: continuation %d failed to open: %s",
                            self._req.request_id, self._count,
                            getattr(exc, "message", "deadline"))
                continue
            self._count_result(label)
            if self._record is not None:
                self._record.ttft_s = ttft  # the client's TTFT, not the continuation's
            return True

    def _give_up(self, deadline: float) -> str | None:
        if self._count >= self._m.max_migrations:
            return "limit"
        if time.perf_counter() >= deadline:
            return "deadline"
        return None

    def _count_result(self, result: str) -> None:
        self._m.metrics.migrations.labels(self._m.mode, result).inc()
        if self._record is not None:
            self._record.migrations = self._count

    async def _open(self, t0: float) -> tuple[StreamResult, str]:
        """Run the continuation's flow; returns its stream and how its prefix got to D."""
        req, ev, m = self._req, self._events, self._m
        prompt = await self._prompt_ids()
        kept = ev.ids[:ev.clean]
        budget = remaining_budget(req, len(kept), len(prompt), m.max_model_len)
        if budget < 1:
            raise RouterError("no completion budget left to continue the stream")
        cont = _continuation(req, prompt + kept, budget, self._count)
        cont.pick_context = dataclasses.replace(PickContext.of(cont), avoid=self._avoid)
        self._served = cont.served_by
        log.warning("request %s: decode failed mid-stream after %d tokens; continuing as %s "
                    "(%d prompt tokens, %d to go)", req.request_id, len(kept),
                    cont.request_id, len(cont.prompt_token_ids or ()), budget)
        result = await m.run(cont, t0)
        if not isinstance(result, StreamResult):
            raise RouterError("the continuation answered without a stream")
        ev.continue_as(len(prompt))
        return result, "kv" if "prefill" in cont.served_by else "recompute"


def _as_stream(req: ClientRequest) -> ClientRequest:
    """A non-streaming request as the stream its flow runs (`Migrator.answer`): streamed
    with usage, its token ids tracked; `served_by` is the client request's own dict, so the
    response headers name the engines that served it."""
    opts = StreamOptions(include_usage=True)
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
    params = msgspec.structs.replace(req.params, stream=True, stream_options=opts)
    return dataclasses.replace(req, body=body, params=params, track_ids=True)


def _continuation(req: ClientRequest, prompt: list[int], budget: int, n: int
                  ) -> ClientRequest:
    """The continuation as a request of its own: a streamed completion over `prompt`, with
    its own engine-side id (`<id>-m<n>`)."""
    body = continuation_body(req, prompt, budget)
    params = CompletionParams(prompt=prompt, model=req.params.model, max_tokens=budget,
                              stream=True, stream_options=StreamOptions(include_usage=True))
    rid = f"{req.request_id}-m{n}"
    return ClientRequest("completion", "/v1/completions", body, params, rid,
                         {**req.engine_headers, "X-Request-Id": rid}, prompt=prompt,
                         prompt_token_ids=prompt, client_headers=req.client_headers,
                         client_request_id=req.client_request_id, track_ids=True,
                         adapter=req.adapter)  # the same LoRA adapter, if any
