"""Token-range mapping between two paged KV caches whose block sizes differ (P 16, D 32...).

One (layer, K|V) plane is `[num_blocks, block_size, H, D]` (contiguous in the layer-major
`LxKVxNBxBSxHxD` layout, strided over blocks in the block-major one), so token slot
`block * block_size + offset` of a plane is at `block * block_stride + offset * token_bytes`
of that plane: token `t` of a request lives at slot
`blocks[t // bs] * bs + t % bs` on each side. Walking the request's tokens in order, a new
piece starts only where a block boundary of either side falls (so pieces are at most the
smaller block size long, and on block boundaries of both sides when one size divides the
other); pieces contiguous on both sides are merged, so a request whose blocks are
consecutive on both sides is one region per plane (layer-major; block-major cuts them again
at block boundaries: one region per (layer, K|V, piece)). Pure Python + numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pdgate.engine_shim.kv_layout import KVLayout

__all__ = ["SlotRun", "region_pairs", "slot_runs", "split_at_blocks"]

SlotRun = tuple[int, int, int]
"""(local slot, remote slot, token count): `count` tokens contiguous on both sides."""


def slot_runs(local_block_size: int, local_blocks: Sequence[int], remote_block_size: int,
              remote_blocks: Sequence[int], num_tokens: int) -> list[SlotRun]:
    """The request's first `num_tokens` tokens as runs of plane slots on both sides, in token
    order, merged where contiguous on both. Raises ValueError when either side's blocks hold
    fewer than `num_tokens` tokens."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    for side, bs, blocks in (("local", local_block_size, local_blocks),
                             ("remote", remote_block_size, remote_blocks)):
        if len(blocks) * bs < num_tokens:
            raise ValueError(f"{len(blocks)} {side} blocks of {bs} tokens cannot hold "
                             f"{num_tokens} tokens")
    runs: list[SlotRun] = []
    t = 0
    while t < num_tokens:
        lb, lo = divmod(t, local_block_size)
        rb, ro = divmod(t, remote_block_size)
        n = min(local_block_size - lo, remote_block_size - ro, num_tokens - t)
        lslot = local_blocks[lb] * local_block_size + lo
        rslot = remote_blocks[rb] * remote_block_size + ro
        if runs and runs[-1][0] + runs[-1][2] == lslot and runs[-1][1] + runs[-1][2] == rslot:
            prev = runs[-1]
            runs[-1] = (prev[0], prev[1], prev[2] + n)
        else:
            runs.append((lslot, rslot, n))
        t += n
    return runs


def region_pairs(local: KVLayout, local_base: int, remote: KVLayout, remote_base: int,
                 runs: Sequence[SlotRun]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """(local, remote) Nx2 arrays of (address, length): every run in every (layer, K|V)
    plane, plane-major, so row i on one side is the same bytes as row i on the other (the
    order `NixlAgent.make_xfer_regions` pairs them in). Layouts must be compatible
    (`KVLayout.incompatibility`): same planes, token size and layout. In the block-major
    layout a plane's slots are contiguous only within a block, so runs are first cut at
    every block boundary of either side."""
    why = local.incompatibility(remote)
    if why is not None:
        raise ValueError(why)
    if local.block_major:
        runs = split_at_blocks(runs, local.block_size, remote.block_size)
    arr = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
    tb = np.uint64(local.token_bytes)
    planes = np.arange(local.num_layers * 2, dtype=np.uint64)[:, None]
    lengths = np.broadcast_to(arr[:, 2] * tb, (planes.shape[0], arr.shape[0]))
    out = []
    for base, layout, col in ((local_base, local, 0), (remote_base, remote, 1)):
        bs = np.uint64(layout.block_size)
        within = (arr[:, col] // bs) * np.uint64(layout.block_stride) + (arr[:, col] % bs) * tb
        addrs = np.uint64(base) + planes * np.uint64(layout.plane_stride) + within[None, :]
        out.append(np.stack([addrs.ravel(), lengths.ravel()], axis=1))
    return out[0], out[1]


def split_at_blocks(runs: Sequence[SlotRun], local_block_size: int,
                    remote_block_size: int) -> list[SlotRun]:
    """`runs` cut so that no piece crosses a block boundary on either side."""
    pieces: list[SlotRun] = []
    for lslot, rslot, count in runs:
        done = 0
        while done < count:
            n = min(local_block_size - (lslot + done) % local_block_size,
                    remote_block_size - (rslot + done) % remote_block_size, count - done)
            pieces.append((lslot + done, rslot + done, n))
            done += n
    return pieces
