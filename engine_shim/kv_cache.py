"""The engine's paged KV memory (one registered buffer) and the pool of its block ids.

`PagedKVCache` owns the single contiguous tensor that `KVLayout` describes; the model reads
and writes it through per-layer views and the NIXL code registers `base_addr` once.
`BlockPool` hands out block ids. Both the engine loop and the NIXL thread (freeing blocks
when a lease expires) touch the pool, hence its lock.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable

import torch

from engine_shim.kv_layout import KVLayout

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class PagedKVCache:
    """One zero-filled tensor `buffer` shaped `layout.shape` on `device` ("cpu", "cuda",
    "cuda:N"). Block b of layer l's K (V) lives at `base_addr + layout.offset(l, 0 (1), b)`.
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
        """View of layer `layer`'s K: `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self.buffer[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        """View of layer `layer`'s V: `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self.buffer[layer, 1]


class OutOfBlocks(Exception):
    """Raised by `BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    """Free-list of block ids `0..num_blocks-1`. Thread-safe.

    `allocate` takes the lowest free ids so one request's blocks tend to be consecutive,
    which lets the transfer code coalesce them into few NIXL descriptors.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self._total = num_blocks
        # The heap yields the lowest free id; the set answers "is it free?" for free().
        self._heap: list[int] = list(range(num_blocks))
        self._free: set[int] = set(self._heap)
        self._lock = threading.Lock()

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_used(self) -> int:
        with self._lock:
            return self._total - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free block ids (ascending). All or nothing: raises OutOfBlocks and takes
        none when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"need {n} blocks, {len(self._free)} of {self._total} free")
            ids = [heapq.heappop(self._heap) for _ in range(n)]
            self._free.difference_update(ids)
            return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks to the pool. Raises ValueError (freeing nothing) when an id is out of
        range, already free, or repeated."""
        ids = list(ids)
        with self._lock:
            bad = [i for i in ids if not 0 <= i < self._total or i in self._free]
            if bad or len(set(ids)) != len(ids):
                raise ValueError(f"double free or unknown block ids: {bad or ids}")
            self._free.update(ids)
            for i in ids:
                heapq.heappush(self._heap, i)
