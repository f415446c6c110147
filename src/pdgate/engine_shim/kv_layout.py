"""Byte layout of an engine's paged KV cache: the one place that knows where a block lives.

All KV memory of an engine is one contiguous buffer, registered with NIXL once, in one of two
layouts (`KVLayout.layout`):

- block-major `NBxLxKVxBSxHxD` (the default): `[num_blocks, num_layers, 2 (K, V), block_size,
  num_kv_heads, head_dim]`. A block of every layer's K and V is one slab, so a run of
  consecutive block ids is ONE transfer descriptor (bench/kv_transfer.py: a 2048-token
  Llama-3-8B request moves at ~1.0x the contiguous NIXL figure on an H200).
- layer-major `LxKVxNBxBSxHxD`: `[num_layers, 2, num_blocks, block_size, ...]`. A run of blocks
  is one descriptor per (layer, K|V): 64 for Llama-3-8B, ~6 us of NIXL posting each.

In both, one (layer, K|V) block is `[block_size, num_kv_heads, head_dim]`, contiguous. Pure
Python (no torch) so the handshake can check layouts anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

DTYPE_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
LAYER_MAJOR = "LxKVxNBxBSxHxD"
BLOCK_MAJOR = "NBxLxKVxBSxHxD"
LAYOUT_NAME = BLOCK_MAJOR  # the default layout
LAYOUTS: dict[str, str] = {"layer": LAYER_MAJOR, "block": BLOCK_MAJOR}
"""`--kv-layout` choice -> layout name."""


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of one engine's KV buffer. Two engines can exchange KV only when
    `incompatibility` finds nothing (same model geometry, dtype and layout; block sizes may
    differ: `block_mapping.py` then maps token ranges)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    layout: str = LAYOUT_NAME

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be > 0")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} not in {sorted(DTYPE_SIZES)}")
        if self.layout not in LAYOUTS.values():
            raise ValueError(f"KVLayout.layout {self.layout!r} not in {sorted(LAYOUTS.values())}")

    @property
    def block_major(self) -> bool:
        return self.layout == BLOCK_MAJOR

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def token_bytes(self) -> int:
        """Bytes of one token slot of one layer's K (or V); a block is `block_size` of them,
        back to back."""
        return self.num_kv_heads * self.head_dim * self.element_size

    @property
    def slab_bytes(self) -> int:
        """Bytes of one block across every layer, K and V (what a block transfer moves)."""
        return self.num_layers * 2 * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.slab_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        tail = (self.block_size, self.num_kv_heads, self.head_dim)
        if self.block_major:
            return (self.num_blocks, self.num_layers, 2, *tail)
        return (self.num_layers, 2, self.num_blocks, *tail)

    @property
    def plane_stride(self) -> int:
        """Bytes between (layer, K|V) planes `p` and `p + 1` (p = layer * 2 + kv) of a block."""
        return self.block_bytes if self.block_major else self.num_blocks * self.block_bytes

    @property
    def block_stride(self) -> int:
        """Bytes between blocks `b` and `b + 1` of one (layer, K|V) plane."""
        return self.slab_bytes if self.block_major else self.block_bytes

    @property
    def descs_per_block(self) -> int:
        """Descriptors of one block in the prepared per-block lists (`block_regions`)."""
        return 1 if self.block_major else self.num_layers * 2

    def offset(self, layer: int, kv: int, block: int) -> int:
        """Byte offset of (layer, K=0|V=1, block) from the buffer's base address."""
        return (layer * 2 + kv) * self.plane_stride + block * self.block_stride

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def incompatibility(self, other: KVLayout) -> str | None:
        """Why KV cannot be copied between `self` and `other`, or None when it can.
        `num_blocks` may differ: each side addresses only its own blocks. `block_size` may
        differ too: within a block the tokens are contiguous in this layout, so a transfer
        maps token ranges (`block_mapping.py`). Mixing layouts is refused: a peer's bytes would
        land in the wrong places."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "layout"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: local {mine!r} vs remote {theirs!r}"
        return None


def coalesce_pairs(
    local: Sequence[int], remote: Sequence[int]
) -> Iterator[tuple[int, int, int]]:
    """Group (local[i], remote[i]) into runs where both sides are consecutive.

    Yields (local_start, remote_start, count); each run becomes one descriptor (block-major)
    or one per (layer, K|V) (layer-major) on each side.
    """
    if len(local) != len(remote):
        raise ValueError(f"block lists differ in length: {len(local)} vs {len(remote)}")
    i = 0
    while i < len(local):
        j = i + 1
        while (
            j < len(local)
            and local[j] == local[j - 1] + 1
            and remote[j] == remote[j - 1] + 1
        ):
            j += 1
        yield local[i], remote[i], j - i
        i = j


def region_list(
    layout: KVLayout, base_addr: int, runs: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """(address, length) of every region holding `runs` ((start_block, count)), in a fixed
    order that both the local and the remote side reproduce, so descriptor i on one side
    matches i on the other: one region per run in block-major, one per (layer, K|V, run)
    (layer-major, plane-major order)."""
    if layout.block_major:
        return [(base_addr + start * layout.slab_bytes, count * layout.slab_bytes)
                for start, count in runs]
    regions: list[tuple[int, int]] = []
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            for start, count in runs:
                regions.append(
                    (base_addr + layout.offset(layer, kv, start), count * layout.block_bytes)
                )
    return regions
