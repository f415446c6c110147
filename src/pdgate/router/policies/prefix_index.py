"""Which engine holds which prompt blocks: chained block hashes and a bounded LRU index.

A prompt's token ids are cut into blocks of `block_size` tokens (only full blocks: engines
cache whole blocks), and block i's hash covers block i's tokens *and* block i-1's hash, so
equal hashes mean equal prefixes. Hashes are Python's `hash()` of `(parent, tokens)` tuples
of ints, which does not depend on `PYTHONHASHSEED`: every router replica computes the same
values for the same tokens, with no coordination.

`PrefixIndex` maps block hashes to the engines believed to hold them, by endpoint key: the
engine's base URL, or `url@rank` for one DP rank of a data-parallel engine (each rank has
its own prefix cache, router/dp_ranks.py). It is used
two ways: as an approximate index (the router records each routing decision: the engine it
sent a prompt to will hold that prompt's blocks) and as the exact index fed by engines' KV
events (`router.kv_events`). It is bounded: past `max_entries` (engine, block) pairs the
least recently used block hash is dropped, with every engine holding it. Lookups and inserts
touch the deepest block first so a prefix's root is always the most recently used part of
it, and eviction eats chains from their tails, never cutting a live chain at its root.

Single-threaded: used on the router's event loop only.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["ROOT_HASH", "PrefixIndex", "block_hashes", "lora_root", "text_block_hashes"]

ROOT_HASH = 0x5D6A7E  # the "parent" of a prompt's first block (any fixed int works)


def lora_root(adapter: str | None, lora_id: int | None = None) -> int:
    """The parent of the first block of a prompt served with LoRA `adapter` (None: the
    base model): the same tokens under another adapter are other KV, so their chains must
    never meet. vLLM keys its own blocks the same way (the adapter's name is in each block
    hash). `lora_id` alone (an event from a vLLM that sends no name) gets a root no request
    has: its blocks can never be credited to the base model or to any adapter. Stable
    across processes (not `hash()` of a str, which PYTHONHASHSEED changes)."""
    if adapter is None and lora_id is None:
        return ROOT_HASH
    key = f"lora:{adapter}" if adapter is not None else f"lora-id:{lora_id}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big",
                          signed=True)


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH
) -> list[int]:
    """Chained hashes of the full `block_size`-token blocks of `token_ids` (a trailing
    partial block is not hashed). `parent` is the hash of the block before the first one."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        out.append(parent)
    return out


def text_block_hashes(text: str, block_chars: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the full `block_chars`-character blocks of `text`: the
    `prefix-text` policy's blocks, no tokenizer needed. Python's `hash()` of a str depends
    on `PYTHONHASHSEED`, so these values are only meaningful inside one process (each
    router process keeps its own index)."""
    out: list[int] = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = hash((parent, text[start : start + block_chars]))
        out.append(parent)
    return out


class PrefixIndex:
    """Block hash -> engines holding it, LRU-bounded to `max_entries` (engine, block) pairs."""

    def __init__(self, max_entries: int) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be > 0, got {max_entries}")
        self.max_entries = max_entries
        self._blocks: OrderedDict[int, set[str]] = OrderedDict()
        self._per_engine: Counter[str] = Counter()
        self._entries = 0

    def __len__(self) -> int:
        """(engine, block) pairs held."""
        return self._entries

    def blocks_of(self, engine: str) -> int:
        """How many blocks `engine` is believed to hold."""
        return self._per_engine[engine]

    def match(self, hashes: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        """For each of `engines`, how many leading blocks of `hashes` it holds (0..len)."""
        alive = set(engines)
        matched = dict.fromkeys(alive, 0)
        depth = 0
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None:
                break
            alive &= holders
            if not alive:
                break
            depth += 1
            for engine in alive:
                matched[engine] = depth
        for h in reversed(hashes[:depth]):
            self._blocks.move_to_end(h)
        return matched

    def insert(self, engine: str, hashes: Sequence[int]) -> None:
        """Record that `engine` holds the blocks `hashes` (a chain, root first)."""
        for h in reversed(hashes):
            holders = self._blocks.get(h)
            if holders is None:
                holders = self._blocks[h] = set()
            else:
                self._blocks.move_to_end(h)
            if engine not in holders:
                holders.add(engine)
                self._per_engine[engine] += 1
                self._entries += 1
        self._evict()

    def remove(self, engine: str, hashes: Iterable[int]) -> None:
        """Forget that `engine` holds `hashes` (unknown ones are ignored)."""
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None or engine not in holders:
                continue
            holders.discard(engine)
            self._dec(engine, 1)
            if not holders:
                del self._blocks[h]

    def clear(self, engine: str) -> None:
        """Forget every block of `engine` (it restarted or cleared its cache)."""
        for h in [h for h, holders in self._blocks.items() if engine in holders]:
            self.remove(engine, (h,))

    def _evict(self) -> None:
        while self._entries > self.max_entries:
            _, holders = self._blocks.popitem(last=False)
            for engine in holders:
                self._dec(engine, 1)

    def _dec(self, engine: str, n: int) -> None:
        self._entries -= n
        self._per_engine[engine] -= n
        if self._per_engine[engine] <= 0:
            del self._per_engine[engine]
