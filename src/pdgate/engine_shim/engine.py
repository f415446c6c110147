"""The engine: model, tokenizer, paged KV cache and block pool behind one request API.

Lifecycle of a request (`await Engine.open(req)` -> `RequestStream`):
1. admission (caller's task): the prompt's blocks are taken now, waiting in FIFO order while
   the pool is short; no blocks within `admission_timeout` is a 503 before any byte is sent;
2. a DECODE-role request (`do_remote_prefill`) gets the prompt's KV from the prefill engine
   through the connector (`kv_inbound.py`: pull, notify or push); on failure the prompt
   is recomputed locally (vLLM's recompute policy), so the request still succeeds;
3. the scheduler (`scheduler.py`) runs it step by step with every other running request;
4. on finish the blocks are freed, or, for a PREFILL-role request (`do_remote_decode`) that
   ran to its length cap, the prompt's blocks go to the connector (`kv_outbound.py`: a
   lease, or a WRITE into D) and the final output carries the `kv_transfer_params`. On
   cancel (client gone) or error they are freed too. No exit path keeps blocks outside the
   pool or a lease. A push-mode prefill that ends any other way than by handing its blocks
   over (not admitted, cancelled, failed, stopped early) tells the connector
   (`fail_push`), which tells the decode engine waiting for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from pdgate.common import char_bound
from pdgate.engine_shim.connector_api import KVConnectorAPI
from pdgate.engine_shim.kv_cache import BlockPool, PagedKVCache
from pdgate.engine_shim.kv_events import KVEventPublisher
from pdgate.engine_shim.kv_inbound import InboundKV, InboundSettings
from pdgate.engine_shim.kv_layout import LAYOUT_NAME
from pdgate.engine_shim.kv_outbound import OutboundKV
from pdgate.engine_shim.logs import fold_library_loggers
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.model import LlamaModel
from pdgate.engine_shim.prefix_cache import PrefixCache
from pdgate.engine_shim.reservations import Reservation, Reservations
from pdgate.engine_shim.sampler import SamplingParams
from pdgate.engine_shim.scheduler import Scheduler
from pdgate.engine_shim.sequence import (
    EngineError,
    EngineStopped,
    GenerateRequest,
    IncrementalDetokenizer,
    KVLoadFailed,
    KVRole,
    OutOfKVBlocks,
    PromptTooLong,
    Sequence,
    StepOutput,
)
from pdgate.engine_shim.staging import HostStaging, create_staging
from pdgate.engine_shim.tracing import record_span, span
from pdgate.engine_shim.transfer_log import TransferLog

__all__ = [
    "Engine", "EngineConfig", "EngineError", "EngineStopped", "KVConnectorAPI", "KVLoadFailed",
    "OutOfKVBlocks", "PromptTooLong", "RequestStream",
]

log = logging.getLogger(__name__)

# Longer texts are tokenized (and chats rendered) in a worker thread: ~1 ms of the event
# loop at most (the router's threshold too).
INLINE_TOKENIZE_CHARS = 2000


@dataclass(frozen=True)
class EngineConfig:
    """Static settings of one engine (built by the CLI or by tests).

    `model`: "tiny" (built-in random-weight model) or a local HF Llama directory.
    `dtype`: None = float32 on CPU, the checkpoint's dtype on CUDA.
    `max_model_len`: None = min(max_position_embeddings, num_blocks * block_size).
    `seed`: seeds the sampling of requests that bring no seed (None: fresh randomness).
    `admission_timeout`: seconds a request may wait (FIFO) for free KV blocks before a 503.
    `kv_digests`: hash the bytes of every handed-over / pulled block set into the transfer
    log (GET /debug/kv_transfers), so tests can check that D received exactly P's bytes."""

    model: str = "tiny"
    served_model_names: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str | None = None
    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int | None = None
    seed: int | None = None
    kv_digests: bool = False
    admission_timeout: float = 60.0
    reserve_seconds: float = 60.0  # notify mode: unclaimed D reservations expire after this
    # Prefix caching (prefix_cache.py): off by default here so library users and unit tests
    # measure cold prompts; the CLI turns it on, as vLLM does. `kv_events_endpoint`: bind a
    # ZMQ PUB socket there and publish KV cache events in vLLM's format (kv_events.py).
    prefix_caching: bool = False
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    # Where the NIXL-registered KV buffer lives (vLLM's kv_buffer_device): None = the KV
    # cache itself; "cpu" = a host staging mirror (staging.py) that transfers copy through.
    kv_buffer_device: str | None = None
    kv_layout: str = LAYOUT_NAME  # KV cache memory layout (kv_layout.LAYOUTS values)
    # A decode whose remote KV cannot be loaded: "recompute" the prompt here (vLLM's
    # default) or "fail" the request with a 502 so the caller sees the transfer failed.
    kv_load_failure_policy: str = "recompute"
    # Notify-mode D: seconds to wait for P's landed notice once the decode leg is here (it
    # trails the router's KV-ready by ~ms; a leg's push_deadline may end the wait sooner).
    landing_timeout: float = 10.0
    push_grace: float = 2.0  # push-mode D: a cancelled wait's blocks stay out (P may write)
    # POST /v1/kv/abort on D: an aborted reservation's blocks stay out of the pool this long
    # when a WRITE into them may still land (`write_possible`).
    reservation_abort_grace: float = 2.0
    max_num_batched_tokens: int = 0  # tokens per step (scheduler.py); 0: no budget
    warmup_tokens: int = 0  # a prompt this long runs once at startup (warmup.py); 0: none


class Engine:
    """Owns model, tokenizer, KV cache and block pool; schedules requests (see module doc).

    Built with `Engine.load(config, metrics)` (blocking: loads weights), then `await start()`
    inside the serving event loop and `await stop()` on shutdown."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: Any,
        model_dir: Path,
        metrics: ShimMetrics,
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.metrics = metrics
        self.block_size = config.block_size
        self.max_model_len = _max_model_len(config, model)
        self.kv = PagedKVCache(model.make_kv_layout(config.num_blocks, config.block_size,
                                                     config.kv_layout),
                               device=str(model.device))
        self.staging: HostStaging | None = create_staging(self.kv, config.kv_buffer_device,
                                                          metrics.registry)
        cache = PrefixCache(config.block_size) if config.prefix_caching else None
        self.pool = BlockPool(config.num_blocks, cache)
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint is not None:
            self.kv_events = KVEventPublisher(config.kv_events_endpoint, config.block_size,
                                              metrics, config.kv_events_topic)
        self.eos_ids = frozenset(_eos_ids(model, tokenizer))
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        # The character bound of early refusals (None: every prompt is tokenized).
        self.max_chars_per_token = None if self._backend is None else \
            char_bound.max_chars_per_token(self._backend)
        self.connector: KVConnectorAPI | None = None
        self.transfer_log = TransferLog(self.kv, config.kv_digests)
        self.scheduler = Scheduler(model, self.kv, self.pool, metrics, self._finish,
                                   after_step=self._publish_kv_events,
                                   on_release=self._released,
                                   max_step_tokens=config.max_num_batched_tokens)
        self.outbound = OutboundKV(self.scheduler, self.staging, self.transfer_log)
        self.inbound = InboundKV(
            InboundSettings(failure_policy=config.kv_load_failure_policy,
                            landing_timeout=config.landing_timeout,
                            push_grace=config.push_grace,
                            reserve_seconds=config.reserve_seconds,
                            vocab_size=model.config.vocab_size),
            self.kv, self.staging, self.scheduler, metrics, self.transfer_log)
        self._admit_counter = itertools.count()
        # Per-request seeds for requests without one when the engine has a seed (vLLM's
        # --seed): the same requests in the same order sample the same tokens.
        self._seeds = None if config.seed is None else random.Random(config.seed)
        metrics.blocks_total.set(config.num_blocks)
        metrics.blocks_free.set_function(lambda: self.pool.num_free)
        metrics.blocks_cached.set_function(lambda: self.pool.num_cached)
        metrics.watch_load(self.served_model_names[0], lambda: self.scheduler.num_waiting,
                           lambda: self.scheduler.num_running,
                           lambda: self.pool.num_used / max(1, self.pool.num_total))

    @classmethod
    def load(cls, config: EngineConfig, metrics: ShimMetrics) -> Engine:
        """Load weights and tokenizer (blocking; call before the server starts)."""
        from transformers import AutoTokenizer

        from pdgate.engine_shim.tiny import ensure_tiny_model

        fold_library_loggers()  # the import gave `transformers` a stderr handler of its own

        model_dir = ensure_tiny_model() if config.model == "tiny" else Path(config.model)
        dtype = config.dtype or ("float32" if config.device == "cpu" else None)
        model = LlamaModel.from_pretrained(model_dir, device=config.device, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(config, model, tokenizer, model_dir, metrics)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        from pdgate.engine_shim.tiny import TINY_MODEL_NAME

        if self.config.served_model_names:
            return self.config.served_model_names
        return (TINY_MODEL_NAME if self.config.model == "tiny" else self.config.model,)

    @property
    def num_waiting(self) -> int:
        """Requests queued for KV blocks (not yet admitted)."""
        return self.scheduler.num_waiting

    @property
    def transfer_memory(self) -> PagedKVCache | HostStaging:
        """What the KV connector registers with NIXL: the host staging mirror when
        `kv_buffer_device="cpu"`, else the KV cache itself."""
        return self.kv if self.staging is None else self.staging

    @property
    def reservations(self) -> Reservations:
        """Notify mode (D): blocks reserved for P's WRITE (`kv_inbound.py`)."""
        return self.inbound.reservations

    def attach_connector(self, connector: KVConnectorAPI | None) -> None:
        """Set the KV connector (the server's lifespan does, after `connector.start()`)."""
        self.connector = self.inbound.connector = self.outbound.connector = connector

    # ---- tokenization: short texts inline, long ones in a worker thread ----

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` (any thread: a fast tokenizer's Rust backend is thread-safe,
        the Python wrapper around it is not). `encode_batch`, not `encode`: only the batch
        call lets go of the GIL, so the event loop runs while a worker thread encodes."""
        if self._backend is not None:
            batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(batch[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def encode_async(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """`encode`, off the event loop for a text over `INLINE_TOKENIZE_CHARS`."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.encode, text, add_special_tokens=add_special_tokens)

    def check_prompt_chars(self, chars: int, max_tokens: int | None) -> None:
        """Refuse a `chars`-character text prompt whose length alone proves it cannot fit
        with `max_tokens` (None: at least one) to generate, before anyone tokenizes it (the
        router's rule, `common/char_bound.py`). Raises PromptTooLong (400). A short text
        is cheap to tokenize: it is left to the exact count (and its exact message)."""
        cpt = self.max_chars_per_token
        limit = char_bound.char_limit(self.max_model_len, max_tokens, cpt)
        if limit is None or cpt is None or chars <= max(limit, INLINE_TOKENIZE_CHARS):
            return
        raise PromptTooLong(
            f"This model's maximum context length is {self.max_model_len} tokens. However,"
            f" the prompt has {chars} characters, at least "
            f"{char_bound.min_tokens(chars, cpt)} tokens, and {max_tokens or 1} are asked for"
            " the completion. Please reduce the prompt or max_tokens.")

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied with the assistant header appended (vLLM renders text,
        then tokenizes it without adding special tokens by default)."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    async def render_chat_async(self, messages: list[dict[str, str]]) -> str:
        """`render_chat`, off the event loop when the messages are long."""
        if sum(len(m["content"]) for m in messages) <= INLINE_TOKENIZE_CHARS:
            return self.render_chat(messages)
        return await asyncio.to_thread(self.render_chat, messages)

    # ---- lifecycle ----

    async def start(self) -> None:
        """Start the model thread and the scheduling loop in the running event loop."""
        if self.kv_events is not None:
            self.kv_events.start()  # first: a port that cannot be bound fails startup
        await self.scheduler.start()
        self.inbound.start()

    async def stop(self) -> None:
        """Stop the loop, fail what is in flight, free every block it held."""
        await self.inbound.stop()
        await self.scheduler.stop()
        await self.outbound.drain()  # hand-overs finish before the connector closes
        self.reservations.release_all()
        self._publish_kv_events()
        if self.kv_events is not None:
            self.kv_events.close()

    def _publish_kv_events(self) -> None:
        """Scheduler hook, once per step: send the prefix cache's events (or drop them)."""
        events = self.pool.take_events()
        if events and self.kv_events is not None:
            self.kv_events.publish(events)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Return blocks to the pool from any thread (the connector frees leases with this)
        and let waiting requests take them."""
        self.scheduler.free_blocks(block_ids)

    # ---- admission ----

    async def open(self, req: GenerateRequest) -> RequestStream:
        """Admit `req`: check its length, then take the prompt's blocks, waiting in FIFO order
        behind earlier requests while the pool is short (blocks come back as requests finish
        and leases end).

        Raises PromptTooLong (400), OutOfKVBlocks (503, no blocks within
        `admission_timeout`) or EngineStopped (503). The caller must close the returned
        stream (`async with`) on every path."""
        opened = time.perf_counter()
        try:
            with span("queue", **{"pdgate.prompt_tokens": len(req.prompt_ids)}):
                return await self._admit(req, opened)
        except (EngineError, asyncio.CancelledError) as e:
            self.outbound.abandoned(req, f"not admitted: {type(e).__name__}: {e}")
            raise

    async def _admit(self, req: GenerateRequest, opened: float) -> RequestStream:
        if not self.scheduler.running:
            raise EngineStopped("engine is not running")
        n = len(req.prompt_ids)
        if n == 0:
            raise PromptTooLong("the prompt is empty")
        if n + req.max_tokens > self.max_model_len:
            raise PromptTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However,"
                f" you requested {n + req.max_tokens} tokens ({n} in the prompt,"
                f" {req.max_tokens} in the completion). Please reduce the prompt or max_tokens."
            )
        if not req.model:  # the metrics' model label
            req = dataclasses.replace(req, model=self.served_model_names[0])
        if req.sampling.seed is None and self._seeds is not None and not req.sampling.greedy:
            seeded = dataclasses.replace(req.sampling, seed=self._seeds.getrandbits(63))
            req = dataclasses.replace(req, sampling=seeded)
        seq = Sequence(
            req=req,
            detok=IncrementalDetokenizer(self.tokenizer, req.prompt_ids),
            eos_ids=self.eos_ids,
            max_model_len=self.max_model_len,
            admit_order=next(self._admit_counter),
        )
        if req.role is not KVRole.DECODE:  # a pull/push target's blocks are written remotely
            self.scheduler.use_prefix_cache(seq)
        timeout = self.config.admission_timeout
        if self.inbound.claim(seq):
            pass  # its prompt's blocks were reserved (notify mode): admitted already
        elif not self.scheduler.try_allocate(seq):
            if not await self.scheduler.wait_for_blocks(seq, timeout):
                raise OutOfKVBlocks(
                    f"out of KV cache blocks: waited {timeout:g}s for "
                    f"{self.scheduler.blocks_for(n)} blocks ({self.pool.num_free} of "
                    f"{self.pool.num_total} free); retry later or send a shorter prompt"
                )
        return RequestStream(self, seq, opened)

    async def reserve(self, request_id: str, num_tokens: int) -> Reservation:
        """Notify mode (D): set aside the blocks of a `num_tokens` prompt that P will WRITE,
        waiting FIFO for them like an admission. Raises PromptTooLong (400), OutOfKVBlocks
        (503) or EngineStopped (503). The blocks are the reservation's until a decode
        request claims them, `reservations.release` or the TTL frees them."""
        if not self.scheduler.running:
            raise EngineStopped("engine is not running")
        if not 0 < num_tokens < self.max_model_len:
            raise PromptTooLong(f"cannot reserve {num_tokens} tokens "
                                f"(max_model_len {self.max_model_len})")
        placeholder = GenerateRequest(request_id=request_id, prompt_ids=(0,) * num_tokens,
                                      sampling=SamplingParams(), max_tokens=1,
                                      model=self.served_model_names[0])
        seq = Sequence(req=placeholder, detok=IncrementalDetokenizer(self.tokenizer, ()),
                       eos_ids=self.eos_ids, max_model_len=self.max_model_len,
                       admit_order=next(self._admit_counter))
        timeout = self.config.admission_timeout
        if not self.scheduler.try_allocate(seq) and \
                not await self.scheduler.wait_for_blocks(seq, timeout):
            raise OutOfKVBlocks(f"out of KV cache blocks: waited {timeout:g}s to reserve "
                                f"{self.scheduler.blocks_for(num_tokens)} blocks")
        blocks, seq.block_ids = seq.block_ids, []
        return self.inbound.reserved(request_id, blocks, num_tokens)

    async def _prepare(self, seq: Sequence) -> None:
        """Runs on the request's first read: a decode gets its remote KV first
        (`kv_inbound.py`), then the scheduler runs it."""
        if seq.req.role is KVRole.DECODE:
            await self.inbound.receive(seq)
        self.scheduler.submit(seq)

    def _finish(self, seq: Sequence, final: StepOutput) -> StepOutput | None:
        """Scheduler hook: a prefill that ran to its length cap hands its KV over
        (`kv_outbound.py`); None while that runs."""
        return self.outbound.finish(seq, final)

    def _released(self, seq: Sequence, status: str) -> None:
        self.outbound.released(seq, status)

class RequestStream:
    """Async iterator of a request's `StepOutput`s; the last has `finish_reason` set.

    Use as `async with await engine.open(req) as stream: async for out in stream: ...`; leaving
    the block early (client disconnect, error) cancels the request and frees its blocks.

    The work (a decode's KV transfer, then the model) starts on the first read, so the time
    between admission and that read is the HTTP layer's: the caller names what it does
    there in `waits_for` (the `await_reader` span's `pdgate.waited_for`). `opened` is the
    `time.perf_counter()` of `Engine.open`, where TTFT and duration are measured from."""

    waits_for = "reader"

    def __init__(self, engine: Engine, seq: Sequence, opened: float) -> None:
        self._engine = engine
        self._seq = seq
        self._started = False
        self._done = False
        self._opened = opened
        self._admitted_ns = time.time_ns()

    @property
    def request_id(self) -> str:
        return self._seq.req.request_id

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent: cancel the request unless it already finished."""
        self._engine.scheduler.cancel(self._seq)

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StepOutput]:
        seq = self._seq
        if not self._started:
            self._started = True
            # Admitted at the end of `queue`; nothing ran for this request until now.
            record_span("await_reader", self._admitted_ns, time.time_ns(), **{
                "pdgate.waited_for": self.waits_for})
            await self._engine._prepare(seq)
        if self._done:
            return
        with span("prefill", **{"pdgate.prompt_tokens": seq.num_prompt,
                                "pdgate.cached_tokens": seq.num_cached_tokens}):
            item = await seq.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        series, role = self._engine.metrics.series(seq.req.model), seq.req.role.value
        series.observe_ttft(role, time.perf_counter() - self._opened)
        # The decode span covers yields, so it is recorded once the stream ends, between
        # the first token and the last output (no current span outlives this frame).
        first = time.time_ns()
        try:
            while True:
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                self._done = item.finish_reason is not None
                if self._done:
                    series.observe_duration(role, time.perf_counter() - self._opened)
                yield item
                if self._done:
                    return
                item = await seq.queue.get()
        finally:
            record_span("decode", first, time.time_ns(), **{
                "pdgate.output_tokens": len(seq.token_ids) - seq.num_prompt,
                "pdgate.finish_reason": seq.finish_reason})


def _max_model_len(config: EngineConfig, model: LlamaModel) -> int:
    capacity = config.num_blocks * config.block_size
    limit = model.config.max_position_embeddings
    if config.max_model_len is None:
        return min(limit, capacity)
    if config.max_model_len > limit:
        raise ValueError(
            f"--max-model-len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings ({limit})"
        )
    if config.max_model_len > capacity:
        raise ValueError(
            f"--max-model-len {config.max_model_len} does not fit the KV pool "
            f"({config.num_blocks} blocks x {config.block_size} = {capacity} tokens); "
            "raise --num-blocks or lower --max-model-len"
        )
    return config.max_model_len


def _eos_ids(model: LlamaModel, tokenizer: Any) -> list[int]:
    ids = set(model.config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)
