"""The engine: model, tokenizer, paged KV cache and block pool behind one request API.

Lifecycle of a request (`await Engine.open(req)` -> `RequestStream`):
1. admission (caller's task): the prompt's blocks are taken now, waiting in FIFO order while
   the pool is short; no blocks within `admission_timeout` is a 503 before any byte is sent;
2. a DECODE-role request (`do_remote_prefill`) reads the prompt's KV from the prefill engine
   through the connector; on failure the prompt is recomputed locally (vLLM's recompute
   policy), so the request still succeeds;
3. the scheduler (`scheduler.py`) runs it step by step with every other running request;
4. on finish the blocks are freed, or, for a PREFILL-role request (`do_remote_decode`) that
   ran to its length cap, the prompt's blocks go to the connector's lease
   (`hold_for_remote_decode`) and the final output carries the `kv_transfer_params`. On
   cancel (client gone) or error they are freed too. No exit path keeps blocks outside the
   pool or a lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import torch

from engine_shim.kv_cache import BlockPool, PagedKVCache
from engine_shim.metrics import ShimMetrics
from engine_shim.model import LlamaModel
from engine_shim.scheduler import Scheduler
from engine_shim.sequence import (
    EngineError,
    EngineStopped,
    GenerateRequest,
    IncrementalDetokenizer,
    KVRole,
    OutOfKVBlocks,
    PromptTooLong,
    Sequence,
    StepOutput,
)
from engine_shim.transfer_errors import KVConnectorError

__all__ = [
    "Engine", "EngineConfig", "EngineError", "EngineStopped", "KVTransfer", "OutOfKVBlocks",
    "PromptTooLong", "RequestStream",
]

log = logging.getLogger(__name__)

_TRANSFER_LOG_LEN = 256  # entries kept for GET /debug/kv_transfers


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


class KVTransfer(Protocol):
    """The connector calls the engine makes (engine_shim/connector.py `KVConnector`)."""

    def hold_for_remote_decode(self, request_id: str, block_ids: list[int]) -> dict[str, Any]:
        """Pin `block_ids` under a lease; return the `kv_transfer_params` for the reply."""
        ...

    async def pull(self, params: Mapping[str, object], local_block_ids: list[int]) -> int:
        """Read the remote prompt blocks into `local_block_ids`; return bytes read. Raises
        KVConnectorError (KVTransferError) on failure."""
        ...

    def abort(self, request_id: str) -> None:
        """Release the leases of `request_id` (router's abort after a failed decode leg)."""
        ...


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
        self.kv = PagedKVCache(model.make_kv_layout(config.num_blocks, config.block_size),
                               device=str(model.device))
        self.pool = BlockPool(config.num_blocks)
        self.eos_ids = frozenset(_eos_ids(model, tokenizer))
        self.connector: KVTransfer | None = None
        self.transfer_log: deque[dict[str, Any]] = deque(maxlen=_TRANSFER_LOG_LEN)
        self.scheduler = Scheduler(model, self.kv, self.pool, metrics, self._finish)
        self._admit_counter = itertools.count()
        # Per-request seeds for requests without one when the engine has a seed (vLLM's
        # --seed): the same requests in the same order sample the same tokens.
        self._seeds = None if config.seed is None else random.Random(config.seed)
        metrics.blocks_total.set(config.num_blocks)
        metrics.blocks_free.set_function(lambda: self.pool.num_free)

    @classmethod
    def load(cls, config: EngineConfig, metrics: ShimMetrics) -> Engine:
        """Load weights and tokenizer (blocking; call before the server starts)."""
        from transformers import AutoTokenizer

        from engine_shim.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model() if config.model == "tiny" else Path(config.model)
        dtype = config.dtype or ("float32" if config.device == "cpu" else None)
        model = LlamaModel.from_pretrained(model_dir, device=config.device, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(config, model, tokenizer, model_dir, metrics)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        from engine_shim.tiny import TINY_MODEL_NAME

        if self.config.served_model_names:
            return self.config.served_model_names
        return (TINY_MODEL_NAME if self.config.model == "tiny" else self.config.model,)

    @property
    def num_waiting(self) -> int:
        """Requests queued for KV blocks (not yet admitted)."""
        return self.scheduler.num_waiting

    def attach_connector(self, connector: KVTransfer | None) -> None:
        """Set the KV connector (the server's lifespan does, after `connector.start()`)."""
        self.connector = connector

    # ---- tokenization (event-loop thread; fast tokenizers are Rust) ----

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied with the assistant header appended (vLLM renders text,
        then tokenizes it without adding special tokens by default)."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    # ---- lifecycle ----

    async def start(self) -> None:
        """Start the model thread and the scheduling loop in the running event loop."""
        await self.scheduler.start()

    async def stop(self) -> None:
        """Stop the loop, fail what is in flight, free every block it held."""
        await self.scheduler.stop()

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
        timeout = self.config.admission_timeout
        if not self.scheduler.try_allocate(seq):
            if not await self.scheduler.wait_for_blocks(seq, timeout):
                raise OutOfKVBlocks(
                    f"out of KV cache blocks: waited {timeout:g}s for "
                    f"{self.scheduler.blocks_for(n)} blocks ({self.pool.num_free} of "
                    f"{self.pool.num_total} free); retry later or send a shorter prompt"
                )
        return RequestStream(self, seq)

    async def _prepare(self, seq: Sequence) -> None:
        """Runs on the request's first read: pull remote KV if asked, then hand to the loop."""
        if seq.req.role is KVRole.DECODE:
            await self._pull_remote(seq)
        self.scheduler.submit(seq)

    async def _pull_remote(self, seq: Sequence) -> None:
        remote = seq.req.remote_block_ids
        n = seq.num_prompt
        if self.connector is None or not remote or len(remote) > self.scheduler.blocks_for(n):
            log.warning(
                "request %s: cannot pull %d remote blocks for a %d-token prompt (connector %s);"
                " recomputing the prompt", seq.req.request_id, len(remote), n,
                "missing" if self.connector is None else "present",
            )
            self.metrics.requests.labels(role="decode", status="recompute").inc()
            return
        local = seq.block_ids[: len(remote)]
        task = asyncio.ensure_future(self.connector.pull(seq.req.remote, local))
        try:
            nbytes = await asyncio.shield(task)
        except asyncio.CancelledError:
            # NIXL may still be writing into these blocks: free them only once it is done.
            blocks, seq.block_ids = seq.block_ids, []
            task.add_done_callback(lambda _t: self.free_blocks(blocks))
            raise
        except Exception as e:  # a failed pull falls back to recompute, never to an error
            if not isinstance(e, KVConnectorError):
                log.exception("request %s: KV pull raised unexpectedly", seq.req.request_id)
            log.warning("request %s: KV pull failed (%s: %s); recomputing the prompt",
                        seq.req.request_id, type(e).__name__, e)
            self.metrics.requests.labels(role="decode", status="recompute").inc()
            return
        # The last prompt token is always recomputed: its logits give the first new token.
        seq.num_computed = min(len(remote) * self.block_size, n - 1)
        seq.num_cached_tokens = seq.num_computed
        self._log_transfer(seq.req.request_id, "decode", local, nbytes)

    def _finish(self, seq: Sequence, final: StepOutput) -> StepOutput:
        """Scheduler hook: a prefill that ran to its length cap hands its prompt's blocks to
        the connector (vLLM: an early stop sends no params and D recomputes)."""
        if seq.req.role is not KVRole.PREFILL or seq.finish_reason != "length":
            return final
        params = self._hand_over(seq)
        return final if params is None else dataclasses.replace(final, kv_transfer_params=params)

    def _hand_over(self, seq: Sequence) -> dict[str, Any] | None:
        """Give the prompt's blocks to the connector's lease; the params for the reply."""
        if self.connector is None:
            log.warning("request %s: do_remote_decode without a connector; no kv_transfer_params",
                        seq.req.request_id)
            return None
        keep = self.scheduler.blocks_for(seq.num_prompt)
        held = seq.block_ids[:keep]
        try:
            params = self.connector.hold_for_remote_decode(seq.req.request_id, held)
        except Exception:
            log.exception("request %s: hold_for_remote_decode failed", seq.req.request_id)
            return None
        seq.block_ids = seq.block_ids[keep:]  # what the lease took is no longer ours to free
        self._log_transfer(seq.req.request_id, "prefill", held,
                           len(held) * 2 * self.kv.layout.num_layers * self.kv.layout.block_bytes)
        return params

    def _log_transfer(self, request_id: str, role: str, blocks: list[int], nbytes: int) -> None:
        """Record a hand-over (P) or a pull (D) for GET /debug/kv_transfers. The digest covers
        the blocks' bytes in (layer, K|V, block) order, the same on both sides."""
        digest = None
        if self.config.kv_digests:
            data = self.kv.buffer[:, :, blocks].contiguous().cpu()
            digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
        self.transfer_log.append({"request_id": request_id, "role": role, "blocks": len(blocks),
                                  "bytes": nbytes, "digest": digest})


class RequestStream:
    """Async iterator of a request's `StepOutput`s; the last has `finish_reason` set.

    Use as `async with await engine.open(req) as stream: async for out in stream: ...`; leaving
    the block early (client disconnect, error) cancels the request and frees its blocks."""

    def __init__(self, engine: Engine, seq: Sequence) -> None:
        self._engine = engine
        self._seq = seq
        self._started = False
        self._done = False

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
        if not self._started:
            self._started = True
            await self._engine._prepare(self._seq)
        while not self._done:
            item = await self._seq.queue.get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._done = item.finish_reason is not None
            yield item


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
