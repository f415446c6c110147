"""Heterogeneous block sizes: the token mapping (pure) and real NIXL pulls between connectors
whose block sizes differ (P 16 tokens per block; D 32, 8 or 12)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pdgate.engine_shim.block_mapping import region_pairs, slot_runs
from pdgate.engine_shim.connector import KVTransferError
from pdgate.engine_shim.kv_cache import PagedKVCache, planes_view
from pdgate.engine_shim.kv_layout import BLOCK_MAJOR, LAYER_MAJOR, KVLayout
from tests.engine_shim.test_transfer import LAYOUT, PeerProcess, _decode, _spawn_p, _stop_p


def _token_slots(block_size: int, blocks: list[int], n: int) -> list[int]:
    return [blocks[t // block_size] * block_size + t % block_size for t in range(n)]


@pytest.mark.parametrize("lbs,rbs", [(16, 16), (32, 16), (16, 32), (12, 16), (1, 7)])
def test_slot_runs_cover_each_token_once_and_merge_what_is_contiguous(lbs: int,
                                                                      rbs: int) -> None:
    rng = random.Random(lbs * 100 + rbs)
    for _ in range(50):
        n = rng.randrange(1, 200)
        local = rng.sample(range(256), -(-n // lbs))
        remote = rng.sample(range(256), -(-n // rbs))
        if rng.random() < 0.5:  # consecutive blocks: the common case after allocate()
            local, remote = sorted(local), sorted(remote)
        runs = slot_runs(lbs, local, rbs, remote, n)
        pairs = [(ls + i, rs + i) for ls, rs, c in runs for i in range(c)]
        assert pairs == list(zip(_token_slots(lbs, local, n), _token_slots(rbs, remote, n),
                                 strict=True))
        for (l0, r0, c0), (l1, r1, _) in zip(runs, runs[1:], strict=False):
            assert not (l0 + c0 == l1 and r0 + c0 == r1)  # adjacent runs were merged


def test_consecutive_blocks_are_one_run_whatever_the_sizes() -> None:
    # P: 3 blocks of 16 (tokens 0..39); D: 2 blocks of 32 starting at block 5.
    assert slot_runs(32, [5, 6], 16, [2, 3, 4], 40) == [(160, 32, 40)]
    # Non-consecutive remote blocks split at their boundaries only.
    assert slot_runs(32, [5, 6], 16, [2, 9, 4], 40) == [(160, 32, 16), (176, 144, 16),
                                                        (192, 64, 8)]


def test_slot_runs_refuse_blocks_too_small_for_the_tokens() -> None:
    with pytest.raises(ValueError, match="1 local blocks of 16 tokens cannot hold 17"):
        slot_runs(16, [0], 32, [0], 17)
    with pytest.raises(ValueError, match="remote"):
        slot_runs(32, [0], 16, [0], 17)


def _layout(bs: int, nb: int = 8, name: str = BLOCK_MAJOR) -> KVLayout:
    return KVLayout(num_layers=3, num_blocks=nb, block_size=bs, num_kv_heads=2, head_dim=4,
                    layout=name)


@pytest.mark.parametrize("name", [BLOCK_MAJOR, LAYER_MAJOR])
def test_regions_move_exactly_the_tokens_between_two_caches(name: str) -> None:
    """Apply region_pairs as memcpys between two byte buffers: every token's K and V of every
    layer lands in the destination's slot, nothing else is touched."""
    src_l, dst_l = _layout(4, nb=9, name=name), _layout(6, nb=7, name=name)
    src = torch.randn(src_l.shape)
    dst = torch.zeros(dst_l.shape)
    src_blocks, dst_blocks, n = [3, 4, 8, 0], [6, 1, 2], 15
    runs = slot_runs(dst_l.block_size, dst_blocks, src_l.block_size, src_blocks, n)
    dregs, sregs = region_pairs(dst_l, 0, src_l, 0, runs)
    sbytes, dbytes = src.view(torch.uint8).numpy().ravel(), dst.view(torch.uint8).numpy().ravel()
    for (da, ln), (sa, ln2) in zip(dregs.tolist(), sregs.tolist(), strict=True):
        assert ln == ln2
        dbytes[da:da + ln] = sbytes[sa:sa + ln]

    def tokens(t: torch.Tensor, lay: KVLayout, blocks: list[int]) -> torch.Tensor:
        return planes_view(t, lay)[:, :, blocks].reshape(3, 2, -1, 2, 4)

    assert torch.equal(tokens(dst, dst_l, dst_blocks)[:, :, :n],
                       tokens(src, src_l, src_blocks)[:, :, :n])
    assert not tokens(dst, dst_l, dst_blocks)[:, :, n:].any()
    untouched = [b for b in range(dst_l.num_blocks) if b not in dst_blocks]
    assert not planes_view(dst, dst_l)[:, :, untouched].any()
    assert int(np.asarray(dregs)[:, 1].sum()) == n * dst_l.token_bytes * 3 * 2


def test_block_major_regions_never_cross_a_block() -> None:
    """Consecutive blocks on both sides: one region per (layer, K|V) in layer-major, but in
    block-major a plane is contiguous only within a block, so one per (plane, piece)."""
    runs = slot_runs(8, [2, 3], 4, [5, 6, 7, 8], 16)
    assert runs == [(16, 20, 16)]
    for name, pieces in ((LAYER_MAJOR, 1), (BLOCK_MAJOR, 4)):
        lregs, rregs = region_pairs(_layout(8, name=name), 0, _layout(4, nb=12, name=name), 0,
                                    runs)
        assert len(lregs) == len(rregs) == 3 * 2 * pieces


# ---- real NIXL: P (block size 16) in another process, D with another block size -----------

def _tokens(kv: PagedKVCache, blocks: list[int], n: int) -> bytes:
    lay = kv.layout
    data = kv.planes()[:, :, blocks].reshape(lay.num_layers, 2, -1, lay.num_kv_heads,
                                           lay.head_dim)[:, :, :n]
    return data.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def prefill16() -> Iterator[PeerProcess]:
    p = _spawn_p("prefill-16", LAYOUT, lease_seconds=60.0)
    yield p
    assert _stop_p(p) == LAYOUT.num_blocks


def _p_tokens(p: PeerProcess, blocks: list[int], n: int) -> bytes:
    raw = np.frombuffer(p.ask("blocks", blocks), dtype=np.uint8)
    per_plane = raw.reshape(LAYOUT.num_layers * 2, -1)[:, : n * LAYOUT.token_bytes]
    return per_plane.tobytes()


@pytest.mark.parametrize("d_block_size", [32, 8, 12])
async def test_pull_maps_p_blocks_onto_d_blocks_of_another_size(
        prefill16: PeerProcess, d_block_size: int) -> None:
    lay = KVLayout(num_layers=2, num_blocks=32, block_size=d_block_size, num_kv_heads=2,
                   head_dim=16)
    n = 37  # 3 P blocks, the last one partly filled
    for conn, kv, metrics in _decode(lay):
        params = prefill16.ask("hold", f"hetero-{d_block_size}", 3)
        local = [7, 8, 9, 10, 2][: -(-n // d_block_size)]
        nbytes = await asyncio.wait_for(conn.pull_tokens(params, local, n), 30)
        assert nbytes == n * lay.token_bytes * lay.num_layers * 2  # the prompt, no padding
        assert _tokens(kv, local, n) == _p_tokens(prefill16, params["remote_block_ids"], n)
        untouched = [b for b in range(lay.num_blocks) if b not in local]
        assert not kv.planes()[:, :, untouched].any()
        state = prefill16.wait_state("leased", 0)  # P's notice arrived: its lease is freed
        assert state["free"] == LAYOUT.num_blocks
        assert metrics.registry.get_sample_value(
            "pdgate_shim_kv_transfer_bytes_total", {"op": "read"}) == nbytes


async def test_pull_without_a_token_count_refuses_another_block_size(
        prefill16: PeerProcess) -> None:
    lay = KVLayout(num_layers=2, num_blocks=32, block_size=32, num_kv_heads=2, head_dim=16)
    for conn, _, _ in _decode(lay):
        params = prefill16.ask("hold", "no-count", 3)
        with pytest.raises(KVTransferError, match="block size 16 .* differs"):
            await asyncio.wait_for(conn.pull(params, [0, 1, 2]), 30)
        with pytest.raises(KVTransferError, match="cannot hold"):  # D's blocks too few
            await asyncio.wait_for(conn.pull_tokens(params, [0], 40), 30)
        await asyncio.wait_for(conn.pull_tokens(params, [0, 1], 40), 30)  # lease still held
        assert prefill16.wait_state("leased", 0)["free"] == LAYOUT.num_blocks

