"""The shim's prefix cache: full prompt blocks kept after their request ends, reused by later
requests with the same prefix (vLLM's automatic prefix caching, on our paged blocks).

A full block's identity is a chained hash of its tokens and of the previous block's hash
(`block_hashes`), so equal hashes mean equal prefixes and the same KV. The `BlockPool` owns
the refcounts and the lock; this class only keeps the maps it consults under that lock:

- `hash -> block` and `block -> hash` for every cached block;
- `evictable`: cached blocks no request or lease references, least recently used first.
  They count as free: the pool evicts them (oldest first) when it runs out of never-used
  blocks, so caching never makes a request wait.

Blocks pinned for a remote decode stay referenced by their lease, so they are never evicted.
Every change is queued as a KV event (`stored` / `removed`) for the engine's publisher
(`engine_shim.kv_events`), in order; `take_events()` drains the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockRemovedEvent", "BlockStoredEvent", "CacheEvent", "PrefixCache", "block_hashes"]

_ROOT = 0x2F1C3A  # the parent "hash" of a prompt's first block


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is not
    hashed). Python's hash of int tuples does not depend on PYTHONHASHSEED."""
    out: list[int] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class BlockStoredEvent:
    """Blocks `hashes` (a chain after `parent`, None for a prompt's first block) now hold
    `token_ids` (len(hashes) x block_size tokens)."""

    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockRemovedEvent:
    """Blocks `hashes` were evicted."""

    hashes: tuple[int, ...]


CacheEvent = BlockStoredEvent | BlockRemovedEvent


class PrefixCache:
    """See the module docstring. Not thread-safe by itself: `BlockPool` calls it under its
    lock."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_hash: dict[int, int] = {}
        self._by_block: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._events: list[CacheEvent] = []

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix block (referenced or not)."""
        return len(self._by_block)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody references (they count as free)."""
        return len(self._evictable)

    def holds(self, block: int) -> bool:
        return block in self._by_block

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes` (root first)."""
        found: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def register(self, blocks: Sequence[int], hashes: Sequence[int],
                 token_ids: Sequence[int]) -> None:
        """Record that `blocks[i]` holds the full block with hash `hashes[i]` (a chain from a
        prompt's first block; `token_ids` are the prompt's tokens). A hash already cached in
        another block, or a block already cached, is left as it is."""
        run: list[int] = []
        run_start = 0
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=False)):
            if h in self._by_hash or block in self._by_block:
                self._flush_run(run, run_start, hashes, token_ids)
                run = []
                continue
            if not run:
                run_start = i
            self._by_hash[h] = block
            self._by_block[block] = h
            run.append(h)
        self._flush_run(run, run_start, hashes, token_ids)

    def _flush_run(self, run: list[int], start: int, hashes: Sequence[int],
                   token_ids: Sequence[int]) -> None:
        if not run:
            return
        bs = self.block_size
        parent = hashes[start - 1] if start > 0 else None
        tokens = tuple(token_ids[start * bs : (start + len(run)) * bs])
        self._events.append(BlockStoredEvent(tuple(run), parent, tokens))

    def park(self, block: int) -> None:
        """`block` (cached) lost its last reference: keep it, evictable, most recent last."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """`block` is referenced again: no longer evictable."""
        self._evictable.pop(block, None)

    def evict(self, n: int) -> list[int]:
        """Drop the `n` least recently used unreferenced blocks from the cache and return
        their ids (the caller must make sure `n <= num_evictable`)."""
        ids: list[int] = []
        removed: list[int] = []
        for _ in range(n):
            block, _ = self._evictable.popitem(last=False)
            removed.append(self._by_hash_remove(block))
            ids.append(block)
        if removed:
            self._events.append(BlockRemovedEvent(tuple(removed)))
        return ids

    def _by_hash_remove(self, block: int) -> int:
        h = self._by_block.pop(block)
        del self._by_hash[h]
        return h

    def take_events(self) -> list[CacheEvent]:
        """The events queued since the last call, oldest first."""
        events, self._events = self._events, []
        return events
