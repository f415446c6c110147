"""The log of KV hand-overs (P) and receptions (D) behind GET /debug/kv_transfers.

With `--kv-digests` each entry carries a sha256 of the bytes of the blocks' first
`num_tokens` token slots in (layer, K|V, token) order, the same on both sides whatever their
block sizes, so tests can check that D received exactly P's bytes. Hashing copies the
blocks, so it runs in a worker thread (`digest` is thread-safe: it only reads the cache).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from typing import Any

import torch

from pdgate.engine_shim.kv_cache import PagedKVCache
from pdgate.engine_shim.tracing import annotate

__all__ = ["TransferLog"]

_LEN = 256  # entries kept


class TransferLog:
    """Bounded, newest last. `digests`: hash the blocks (see the module docstring)."""

    def __init__(self, kv: PagedKVCache, digests: bool) -> None:
        self._kv = kv
        self.digests = digests
        self.entries: deque[dict[str, Any]] = deque(maxlen=_LEN)

    def nbytes(self, blocks: int) -> int:
        """Bytes of `blocks` whole blocks (every layer, K and V)."""
        layout = self._kv.layout
        return blocks * 2 * layout.num_layers * layout.block_bytes

    def digest(self, blocks: list[int], num_tokens: int | None) -> str | None:
        """Any thread: the digest of `blocks` (None when digests are off)."""
        if not self.digests:
            return None
        data = self._kv.planes()[:, :, blocks]
        if num_tokens is not None:
            lay = self._kv.layout
            data = data.reshape(lay.num_layers, 2, -1, lay.num_kv_heads, lay.head_dim)
            data = data[:, :, :num_tokens]
        data = data.contiguous().cpu()
        return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()

    def add(self, request_id: str, role: str, blocks: list[int], nbytes: int,
            digest: str | None) -> None:
        """Event-loop thread: append an entry (and annotate the current span, if any)."""
        annotate(**{"pdgate.kv.bytes": nbytes, "pdgate.kv.descriptors": len(blocks)})
        self.entries.append({"request_id": request_id, "role": role, "blocks": len(blocks),
                             "bytes": nbytes, "digest": digest})

    async def record(self, request_id: str, role: str, blocks: list[int], nbytes: int,
                     num_tokens: int | None = None) -> None:
        """`add`, hashing in a worker thread first when digests are on."""
        digest = None
        if self.digests:
            digest = await asyncio.to_thread(self.digest, blocks, num_tokens)
        self.add(request_id, role, blocks, nbytes, digest)
