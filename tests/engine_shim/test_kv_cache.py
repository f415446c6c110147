"""Block pool bookkeeping and the paged cache's byte layout (what NIXL will transfer)."""

from __future__ import annotations

import threading

import pytest
import torch

from pdgate.engine_shim.kv_cache import BlockPool, OutOfBlocks, PagedKVCache
from pdgate.engine_shim.kv_layout import (
    BLOCK_MAJOR,
    LAYER_MAJOR,
    LAYOUT_NAME,
    KVLayout,
    region_list,
)


def test_allocate_prefers_lowest_free_ids() -> None:
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([1, 0])
    assert pool.allocate(3) == [0, 1, 5]
    assert (pool.num_free, pool.num_used, pool.num_total) == (2, 6, 8)


def test_exhaustion_allocates_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]
    assert pool.allocate(0) == []


@pytest.mark.parametrize("bad", [[2], [7], [-1], [0, 0]])
def test_double_free_and_unknown_ids_are_rejected(bad: list[int]) -> None:
    pool = BlockPool(4)
    pool.allocate(1)  # block 0 in use; 2 is free, 7 and -1 do not exist
    with pytest.raises(ValueError, match="double free or unknown"):
        pool.free(bad)
    assert pool.num_used == 1  # a rejected free changes nothing


def test_pool_returns_to_full_under_concurrent_use() -> None:
    pool = BlockPool(64)

    def churn() -> None:
        for _ in range(200):
            try:
                ids = pool.allocate(3)
            except OutOfBlocks:
                continue
            pool.free(ids)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.num_free == 64


@pytest.mark.parametrize(("dtype", "name"), [("float32", BLOCK_MAJOR), ("bfloat16", BLOCK_MAJOR),
                                            ("float32", LAYER_MAJOR)])
def test_views_alias_the_buffer_at_layout_offsets(dtype: str, name: str) -> None:
    layout = KVLayout(
        num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
        layout=name,
    )
    kv = PagedKVCache(layout, "cpu")
    assert kv.buffer.shape == layout.shape and not kv.buffer.any()
    assert (kv.mem_type, kv.device_id) == ("DRAM", 0)
    assert kv.base_addr == kv.buffer.data_ptr()
    assert kv.buffer.numel() * kv.buffer.element_size() == layout.total_bytes
    raw = kv.buffer.view(-1).view(torch.uint8)
    for layer, kind, block, view in [(1, 0, 3, kv.key), (0, 1, 2, kv.value)]:
        src = torch.arange(4 * 2 * 8, dtype=torch.float32).view(4, 2, 8) + 100 * layer + kind
        view(layer)[block] = src.to(kv.buffer.dtype)
        assert view(layer).shape == (5, 4, 2, 8)
        start = layout.offset(layer, kind, block)
        expected = src.to(kv.buffer.dtype).contiguous().view(-1).view(torch.uint8)
        assert torch.equal(raw[start : start + layout.block_bytes], expected)
    assert int(raw.ne(0).sum()) <= 2 * layout.block_bytes  # nothing else was touched


def test_block_major_is_the_default_and_a_block_run_is_one_region() -> None:
    lay = KVLayout(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
    assert lay.layout == LAYOUT_NAME == BLOCK_MAJOR and lay.shape == (6, 3, 2, 4, 2, 8)
    slab = 3 * 2 * lay.block_bytes
    assert region_list(lay, 1000, [(2, 3), (0, 1)]) == [(1000 + 2 * slab, 3 * slab),
                                                       (1000, slab)]
    layer = KVLayout(3, 6, 4, 2, 8, layout=LAYER_MAJOR)
    assert layer.shape == (3, 2, 6, 4, 2, 8)
    assert len(region_list(layer, 0, [(2, 3), (0, 1)])) == 3 * 2 * 2
    assert sum(n for _, n in region_list(layer, 0, [(2, 3)])) == 3 * slab


def test_mixing_layouts_is_refused_and_unknown_layouts_rejected() -> None:
    block = KVLayout(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
    layer = KVLayout(3, 6, 4, 2, 8, layout=LAYER_MAJOR)
    assert block.incompatibility(layer) == (
        f"layout differs: local {BLOCK_MAJOR!r} vs remote {LAYER_MAJOR!r}")
    with pytest.raises(ValueError, match="KVLayout.layout"):
        KVLayout(3, 6, 4, 2, 8, layout="BSxNB")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_reports_vram() -> None:
    layout = KVLayout(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8)
    kv = PagedKVCache(layout, "cuda:0")
    assert (kv.mem_type, kv.device_id) == ("VRAM", 0)
