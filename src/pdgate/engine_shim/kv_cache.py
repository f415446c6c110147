"""The engine's paged KV memory (one registered buffer) and the pool of its block ids.

`PagedKVCache` owns the single contiguous tensor that `KVLayout` describes; the model reads
and writes it through per-layer views and the NIXL code registers `base_addr` once.
`BlockPool` hands out block ids. Both the engine loop and the NIXL thread (freeing blocks
when a lease expires) touch the pool, hence its lock.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable, Sequence

import torch

from pdgate.engine_shim.kv_layout import KVLayout
from pdgate.engine_shim.prefix_cache import CacheEvent, PrefixCache

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class PagedKVCache:
    """One zero-filled tensor `buffer` shaped `layout.shape` on `device` ("cpu", "cuda",
    "cuda:N"). Block b of layer l's K (V) lives at `base_addr + layout.offset(l, 0 (1), b)`,
    in either layout (`KVLayout.layout`).
    The buffer is never reallocated, so `base_addr` stays valid for NIXL registration."""

    def __init__(self, layout: KVLayout, device: str = "cpu") -> None:
        self.layout = layout
        self.buffer = torch.zeros(
            layout.shape, dtype=TORCH_DTYPES[layout.dtype], device=torch.device(device)
        )

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def base_addr(self) -> int:
        """Address of byte 0 of the buffer (what NIXL registers)."""
        return int(self.buffer.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    @property
    def mem_type(self) -> str:
        """NIXL memory type: "VRAM" for CUDA buffers, "DRAM" otherwise."""
        return "VRAM" if self.buffer.device.type == "cuda" else "DRAM"

    @property
    def device_id(self) -> int:
        """CUDA device index (0 for host memory), as NIXL descriptors want it."""
        index = self.buffer.device.index
        return 0 if index is None else int(index)

    def key(self, layer: int) -> torch.Tensor:
        """View of layer `layer`'s K: `[num_blocks, block_size, num_kv_heads, head_dim]`
        (strided over blocks in the block-major layout; each block is contiguous)."""
        return self.planes()[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        """View of layer `layer`'s V: `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self.planes()[layer, 1]

    def planes(self) -> torch.Tensor:
        """The buffer viewed `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
        whatever its layout (a permuted view in block-major), for code that indexes blocks
        per (layer, K|V): `planes()[:, :, block_ids]`."""
        return planes_view(self.buffer, self.layout)


def planes_view(buffer: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """`buffer` (shaped `layout.shape`) viewed `[num_layers, 2, num_blocks, ...]`."""
    return buffer.permute(1, 2, 0, 3, 4, 5) if layout.block_major else buffer


class OutOfBlocks(Exception):
    """Raised by `BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    """Block ids `0..num_blocks-1` with reference counts. Thread-safe.

    `allocate` takes the lowest never-used (or freed, uncached) ids so one request's blocks
    tend to be consecutive, which lets the transfer code coalesce them into few NIXL
    descriptors. With a `PrefixCache`, a block whose last reference is freed stays cached
    (evictable) and still counts as free: `allocate` evicts the least recently used such
    blocks when it runs out of the others. `share` adds references to cached blocks that a
    new request reuses; `free` drops one reference per id.
    """

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self._total = num_blocks
        self.cache = cache
        # The heap yields the lowest free id; the set answers "is it free?" for free().
        self._heap: list[int] = list(range(num_blocks))
        self._free: set[int] = set(self._heap)
        self._refs: list[int] = [0] * num_blocks
        self._lock = threading.Lock()

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_free(self) -> int:
        """Blocks no request or lease references (never used, freed, or cached-evictable)."""
        with self._lock:
            return self._num_free()

    @property
    def num_used(self) -> int:
        with self._lock:
            return self._total - self._num_free()

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix block, referenced or not."""
        with self._lock:
            return self.cache.num_cached if self.cache is not None else 0

    def _num_free(self) -> int:
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free block ids (ascending among never-used ones, then evicted cached
        ones). All or nothing: raises OutOfBlocks and takes none when fewer than `n` are
        free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            if n > self._num_free():
                raise OutOfBlocks(
                    f"need {n} blocks, {self._num_free()} of {self._total} free"
                )
            take = min(n, len(self._free))
            ids = [heapq.heappop(self._heap) for _ in range(take)]
            self._free.difference_update(ids)
            if take < n:
                assert self.cache is not None
                ids += self.cache.evict(n - take)
            for i in ids:
                self._refs[i] = 1
            return ids

    def share(self, ids: Iterable[int]) -> None:
        """Add one reference to each of `ids` (cached blocks a new request reuses)."""
        with self._lock:
            for i in ids:
                if self._refs[i] == 0 and self.cache is not None:
                    self.cache.unpark(i)
                self._refs[i] += 1

    def acquire_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes`, each with one more
        reference (the caller frees them like any allocated block). [] without a cache."""
        if self.cache is None:
            return []
        with self._lock:
            found = self.cache.lookup(hashes)
            for i in found:
                if self._refs[i] == 0:
                    self.cache.unpark(i)
                self._refs[i] += 1
            return found

    def register(self, ids: Sequence[int], hashes: Sequence[int],
                 token_ids: Sequence[int]) -> None:
        """Cache the full prompt blocks `ids` under `hashes` (no-op without a cache)."""
        if self.cache is None:
            return
        with self._lock:
            self.cache.register(ids, hashes, token_ids)

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference from each of `ids`; a block with none left becomes free
        (cached ones stay cached, evictable). Raises ValueError (freeing nothing) when an id
        is out of range, not referenced, or repeated."""
        ids = list(ids)
        with self._lock:
            bad = [i for i in ids if not 0 <= i < self._total or self._refs[i] <= 0]
            if bad or len(set(ids)) != len(ids):
                raise ValueError(f"double free or unknown block ids: {bad or ids}")
            for i in ids:
                self._refs[i] -= 1
                if self._refs[i]:
                    continue
                if self.cache is not None and self.cache.holds(i):
                    self.cache.park(i)
                else:
                    self._free.add(i)
                    heapq.heappush(self._heap, i)

    def take_events(self) -> list[CacheEvent]:
        """The prefix cache's queued events (stored / removed), oldest first."""
        if self.cache is None:
            return []
        with self._lock:
            return self.cache.take_events()
