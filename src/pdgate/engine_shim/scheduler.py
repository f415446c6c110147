"""The engine's scheduler: which sequences run, wait for KV blocks or are preempted, and the
step loop that drives the model.

Threads: scheduling state lives on the event-loop thread; every torch call runs on ONE model
thread (a single-worker executor) that gets immutable `Work` snapshots, so the event loop never
blocks and the model (not thread-safe) sees one forward at a time. Blocks are freed from other
threads only through `free_blocks` (the connector's lease release), which wakes the loop.

A step feeds every running sequence its pending tokens (`token_ids[num_computed:]`): prefill
and recompute one sequence per forward, all single-token decodes in one batched forward, then
samples one token each. With a token budget (`max_step_tokens`, vLLM's
`--max-num-batched-tokens`) a step takes every decode, then prompts in arrival order while
the budget lasts (at least one; prompts are not chunked): a prompt's first token then waits
only for the prompts ahead of it, not for those that arrive after it in the same step.
Blocks grow as sequences lengthen; when the pool is dry the youngest
running sequence is preempted (blocks freed, recomputed later, before any new admission).
Requests that find the pool short at admission wait in FIFO order.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdgate.engine_shim.kv_cache import BlockPool, OutOfBlocks, PagedKVCache
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.model import LlamaModel
from pdgate.engine_shim.prefix_cache import block_hashes
from pdgate.engine_shim.sequence import EngineError, EngineStopped, Sequence, StepOutput

log = logging.getLogger(__name__)

FinishHook = Callable[[Sequence, StepOutput], StepOutput | None]


@dataclass(frozen=True)
class Work:
    """Immutable snapshot of one sequence's step, handed to the model thread."""

    seq: Sequence
    ids: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    banned: tuple[int, ...]


class Scheduler:
    """See the module docstring. `on_finish(seq, final_output)` runs (event-loop thread) when
    a sequence finishes, before its remaining blocks are freed; it returns the final output
    to deliver, or None when it takes the sequence over: the engine then hands a prefill's
    blocks to the connector off the loop, and calls `release(seq, "ok")` and delivers the
    final output itself once that is done."""

    def __init__(
        self, model: LlamaModel, kv: PagedKVCache, pool: BlockPool, metrics: ShimMetrics,
        on_finish: FinishHook, after_step: Callable[[], None] | None = None,
        on_release: Callable[[Sequence, str], None] | None = None,
        max_step_tokens: int = 0,
    ) -> None:
        self.model = model
        self.max_step_tokens = max_step_tokens  # 0: no budget
        self.kv = kv
        self.pool = pool
        self.metrics = metrics
        self.block_size = kv.layout.block_size
        self._on_finish = on_finish
        self._after_step = after_step
        self._on_release = on_release
        # Sequences that may reuse cached prefix blocks (prefix_cache.py): colocated and
        # prefill requests; never one whose blocks a remote engine writes or we pull into.
        self._prefix_ok: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self._running: list[Sequence] = []
        self._preempted: list[Sequence] = []
        # Admissions queued for blocks, in arrival order, with when each began to wait.
        self._waiting: deque[tuple[Sequence, asyncio.Future[None], float]] = deque()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    @property
    def num_running(self) -> int:
        """Sequences admitted and not finished (running or preempted)."""
        return len(self._running) + len(self._preempted)

    @property
    def num_waiting(self) -> int:
        """Requests queued for KV blocks (not yet admitted)."""
        return sum(1 for _, fut, _ in self._waiting if not fut.done())

    def starved_need(self, min_wait_s: float) -> int:
        """Blocks the first queued admission still lacks once it has waited `min_wait_s`
        (0 before, or with none queued). Reads only: safe from the connector's thread.
        Cancelled waiters the loop has not dropped yet are skipped."""
        try:
            head = next(((seq, since) for seq, fut, since in self._waiting if not fut.done()),
                        None)
        except RuntimeError:  # the loop changed the queue meanwhile: the next tick asks again
            return 0
        if head is None or time.monotonic() - head[1] < min_wait_s:
            return 0
        seq = head[0]
        need = self.blocks_for(len(seq.token_ids)) - len(seq.block_ids)
        return max(0, need - self.pool.num_free)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def use_prefix_cache(self, seq: Sequence) -> None:
        """Let `seq` start from cached prefix blocks whenever it (re)gets blocks. Only for
        requests whose blocks only this engine writes (not a pull or push target)."""
        if self.pool.cache is not None:
            self._prefix_ok.add(seq)

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shim-model")
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="shim-engine-loop")

    async def stop(self) -> None:
        """Stop the loop, fail what is in flight, free every block it held."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for seq in self._running + self._preempted:
            self.release(seq, "aborted")
            seq.queue.put_nowait(EngineStopped("engine is shutting down"))
        self._running.clear()
        self._preempted.clear()
        for _, fut, _ in self._waiting:
            if not fut.done():
                fut.set_exception(EngineStopped("engine is shutting down"))
        self._waiting.clear()
        self._loop = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---- admission and hand-off (event-loop thread unless noted) ----

    def try_allocate(self, seq: Sequence) -> bool:
        """Take the prompt's blocks now, unless earlier requests wait or the pool is short."""
        return not (self._waiting or self._preempted) and self._grow(seq)

    async def wait_for_blocks(self, seq: Sequence, timeout: float) -> bool:
        """Queue for the prompt's blocks (FIFO); False when `timeout` seconds pass first."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((seq, fut, time.monotonic()))
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            if not fut.done():
                fut.cancel()  # the loop drops cancelled waiters
                return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(seq, "aborted")  # admitted, but the caller is gone
            fut.cancel()
            raise
        return True

    def free_blocks(self, block_ids: list[int]) -> None:
        """Return blocks from any thread (the connector's lease release) and wake the loop."""
        self.pool.free(block_ids)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    def submit(self, seq: Sequence) -> None:
        """Start running an admitted sequence; from now on the loop owns its blocks."""
        seq.submitted = True
        self._running.append(seq)
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """The request's reader is gone (finished, disconnected or failed)."""
        if seq.finished:
            return
        if seq.submitted:
            seq.cancelled = True  # freed by the loop between steps, never under the model
            self._wake.set()
        else:
            self.release(seq, "aborted")

    def release(self, seq: Sequence, status: str) -> None:
        """Free the sequence's blocks (exactly once), count the request and tell the
        `on_release(seq, status)` hook ("ok", "aborted" or "error")."""
        if seq.block_ids:
            self.pool.free(seq.block_ids)
            seq.block_ids = []
            self._wake.set()
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        self.metrics.series(seq.req.model).count_request(seq.req.role.value, status)
        if self._on_release is not None:
            self._on_release(seq, status)

    # ---- the loop ----

    async def _run(self) -> None:
        while True:
            try:
                await self._iteration()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug must not leave every request hanging
                log.exception("engine loop iteration failed; failing all in-flight requests")
                self._fail(self._running + self._preempted, e)

    async def _iteration(self) -> None:
        # Clear before looking at the state, so a wake-up that arrives while we schedule
        # is not lost: every state change (new request, cancel, freed blocks) sets it.
        self._wake.clear()
        self._reap_cancelled()
        work = self._schedule()
        self._admit_waiting()
        if self._after_step is not None:
            self._after_step()  # e.g. publish the step's KV cache events
        if not work:
            await self._wake.wait()
            return
        assert self._executor is not None
        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(self._executor, self._compute, work)
        except Exception as e:
            log.exception("model step failed; failing %d request(s)", len(work))
            self._fail([w.seq for w in work], e)
            return
        self._commit(work, tokens)

    def _reap_cancelled(self) -> None:
        for group in (self._running, self._preempted):
            for seq in [s for s in group if s.cancelled]:
                group.remove(seq)
                self.release(seq, "aborted")

    def _schedule(self) -> list[Work]:
        """Re-admit preempted sequences when possible, grow blocks for every running one
        (preempting the youngest when the pool is dry) and snapshot this step's work."""
        while self._preempted and self._grow(self._preempted[0]):
            self._running.append(self._preempted.pop(0))
        work: list[Work] = []
        for seq in list(self._running):
            if seq not in self._running:
                continue  # preempted while making room for an older sequence
            while not self._grow(seq):
                victim = self._running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                work.append(Work(
                    seq=seq,
                    ids=tuple(seq.token_ids[seq.num_computed :]),
                    start=seq.num_computed,
                    blocks=tuple(seq.block_ids),
                    banned=seq.banned_tokens(),
                ))
        return within_budget(work, self.max_step_tokens) if self.max_step_tokens else work

    def _admit_waiting(self) -> None:
        """Hand prompt blocks to waiting requests in arrival order (after preempted ones)."""
        while self._waiting and not self._preempted:
            seq, fut, _ = self._waiting[0]
            if not fut.done():
                if not self._grow(seq):
                    return
                fut.set_result(None)
            self._waiting.popleft()

    def _grow(self, seq: Sequence) -> bool:
        """Make `seq.block_ids` cover all of `seq.token_ids`; False if the pool is short."""
        if not seq.block_ids and seq in self._prefix_ok:
            return self._grow_from_prefix(seq)
        need = self.blocks_for(len(seq.token_ids)) - len(seq.block_ids)
        if need <= 0:
            return True
        try:
            seq.block_ids.extend(self.pool.allocate(need))
        except OutOfBlocks:
            return False
        return True

    def _grow_from_prefix(self, seq: Sequence) -> bool:
        """First blocks of a sequence: reuse the longest cached prefix, allocate the rest
        (all or nothing). The block holding the last token is never reused: its logits
        must be computed (and a shared block is never written)."""
        bs, n = self.block_size, len(seq.token_ids)
        usable = min((n - 1) // bs, seq.num_prompt // bs)
        hit = self.pool.acquire_prefix(block_hashes(seq.req.prompt_ids[: usable * bs], bs))
        try:
            fresh = self.pool.allocate(self.blocks_for(n) - len(hit))
        except OutOfBlocks:
            if hit:
                self.pool.free(hit)
            return False
        seq.block_ids = hit + fresh
        seq.num_computed = len(hit) * bs
        if seq.num_output == 0:  # first admission, not a recompute after preemption
            seq.num_cached_tokens = seq.num_computed
            self.metrics.prefix_cache_queries.inc(seq.num_prompt)
            self.metrics.prefix_cache_hits.inc(seq.num_computed)
        return True

    def _register_prompt(self, seq: Sequence) -> None:
        """The prompt's full blocks are computed: offer them to the prefix cache."""
        full = seq.num_prompt // self.block_size
        if full and len(seq.block_ids) >= full:
            prompt = seq.req.prompt_ids
            hashes = block_hashes(prompt[: full * self.block_size], self.block_size)
            self.pool.register(seq.block_ids[:full], hashes, prompt)

    def _preempt(self, seq: Sequence) -> None:
        log.info("preempting request %s (KV pool exhausted); it will be recomputed",
                 seq.req.request_id)
        self._running.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids, seq.num_computed = [], 0
        self._preempted.append(seq)
        self._preempted.sort(key=lambda s: s.admit_order)

    def _compute(self, work: list[Work]) -> list[int]:
        """Model thread: one forward per prefill, one batched forward for all decodes."""
        logits: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            decodes = [i for i, w in enumerate(work) if len(w.ids) == 1]
            for i, w in enumerate(work):
                if len(w.ids) > 1:
                    ids = torch.tensor(w.ids, dtype=torch.long)
                    out = self.model.forward_paged(ids, w.start, w.blocks, self.kv, last_only=True)
                    logits[i] = out[-1]
            if decodes:
                ids = torch.tensor([work[i].ids[0] for i in decodes], dtype=torch.long)
                out = self.model.forward_paged_batch(
                    ids, [work[i].start for i in decodes], [work[i].blocks for i in decodes],
                    self.kv,
                )
                logits.update(zip(decodes, out, strict=True))
            return [_sample(w, logits[i]) for i, w in enumerate(work)]

    def _commit(self, work: list[Work], tokens: list[int]) -> None:
        for w, token in zip(work, tokens, strict=True):
            seq = w.seq
            if seq.cancelled or seq not in self._running:
                continue
            seq.num_computed = w.start + len(w.ids)
            if self.pool.cache is not None and w.start < seq.num_prompt <= seq.num_computed:
                self._register_prompt(seq)
            prompt_part = max(0, min(seq.num_prompt, seq.num_computed) - w.start)
            series = self.metrics.series(seq.req.model)
            if prompt_part:
                series.prompt_tokens.inc(prompt_part)
            series.generation_tokens.inc()
            out = seq.append(token)
            if seq.finished:
                self._running.remove(seq)
                out = self._on_finish(seq, out if out is not None else seq.output(""))
                if out is None:
                    continue  # taken over (a hand-over in flight)
                self.release(seq, "ok")
            if out is not None:
                seq.queue.put_nowait(out)

    def _fail(self, seqs: list[Sequence], error: Exception) -> None:
        for seq in seqs:
            for group in (self._running, self._preempted):
                if seq in group:
                    group.remove(seq)
                    self.release(seq, "error")
                    seq.queue.put_nowait(EngineError(f"model step failed: {error}"))


def within_budget(work: list[Work], max_tokens: int) -> list[Work]:
    """A step's work within `max_tokens`: every decode (one token), then prompts in the
    order given (arrival) while the budget lasts, at least one; the prompts left out stay
    running and go in a later step."""
    budget = max_tokens - sum(len(w.ids) == 1 for w in work)
    kept: list[Work] = []
    prompts = 0
    for w in work:
        if len(w.ids) > 1:
            if prompts and len(w.ids) > budget:
                budget = 0  # first come, first served: no later prompt jumps this one
                continue
            prompts += 1
            budget -= len(w.ids)
        kept.append(w)
    return kept


def _sample(w: Work, row: torch.Tensor) -> int:
    if w.banned:
        row = row.clone()
        row[list(w.banned)] = float("-inf")
    return w.seq.sampler.sample(row)
