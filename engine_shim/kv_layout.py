"""Byte layout of an engine's paged KV cache: the one place that knows where a block lives.

All KV memory of an engine is one contiguous buffer shaped
`[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`, registered with NIXL
once. Per layer, K and V are each `[num_blocks, block_size, num_kv_heads, head_dim]` and a block
is contiguous, so consecutive block ids are adjacent in memory and a run of them is one
transfer descriptor. Pure Python (no torch) so the handshake can check layouts anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

DTYPE_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
LAYOUT_NAME = "LxKVxNBxBSxHxD"


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of one engine's KV buffer. Two engines can exchange blocks only when
    `compatible_with` says so (same model geometry, block size and dtype)."""

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

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def total_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
            self.head_dim,
        )

    def offset(self, layer: int, kv: int, block: int) -> int:
        """Byte offset of (layer, K=0|V=1, block) from the buffer's base address."""
        return ((layer * 2 + kv) * self.num_blocks + block) * self.block_bytes

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def incompatibility(self, other: KVLayout) -> str | None:
        """Why blocks cannot be copied between `self` and `other`, or None when they can.
        `num_blocks` may differ: each side addresses only its own blocks."""
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "layout"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: local {mine!r} vs remote {theirs!r}"
        return None


def coalesce_pairs(
    local: Sequence[int], remote: Sequence[int]
) -> Iterator[tuple[int, int, int]]:
    """Group (local[i], remote[i]) into runs where both sides are consecutive.

    Yields (local_start, remote_start, count); each run becomes one descriptor per
    (layer, K|V) on each side.
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
    """(address, length) of every (layer, K|V, run) region, in a fixed order that both the
    local and the remote side reproduce, so descriptor i on one side matches i on the other.
    `runs` are (start_block, count)."""
    regions: list[tuple[int, int]] = []
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            for start, count in runs:
                regions.append(
                    (base_addr + layout.offset(layer, kv, start), count * layout.block_bytes)
                )
    return regions
