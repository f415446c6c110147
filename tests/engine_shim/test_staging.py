"""Host staging (`--kv-buffer-device cpu`): the host mirror NIXL registers in place of the KV
cache, and the copies device <-> host of exactly the transferred blocks. (CPU here; the same
class drives pinned memory and a CUDA stream on a GPU engine.) End to end through `pdgate up`:
tests/e2e/test_pd_hetero.py."""

from __future__ import annotations

import msgspec
import pytest
import torch
from prometheus_client import CollectorRegistry

from pdgate.engine_shim.kv_cache import PagedKVCache, planes_view
from pdgate.engine_shim.kv_layout import BLOCK_MAJOR, LAYER_MAJOR, KVLayout
from pdgate.engine_shim.staging import HostStaging, block_runs, create_staging

LAYOUT = KVLayout(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8)


def _cache(seed: int, layout: KVLayout = LAYOUT) -> PagedKVCache:
    kv = PagedKVCache(layout, "cpu")
    kv.buffer.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def test_block_runs_group_consecutive_ids() -> None:
    assert block_runs([5, 3, 4, 9, 0, 9]) == [(0, 1), (3, 3), (9, 1)]
    assert block_runs([]) == []


def test_no_staging_unless_asked_and_cuda_needs_a_cuda_engine() -> None:
    kv = _cache(0)
    assert create_staging(kv, None, CollectorRegistry()) is None
    with pytest.raises(ValueError, match="needs a CUDA engine"):
        create_staging(kv, "cuda", CollectorRegistry())
    with pytest.raises(ValueError, match="must be one of"):
        create_staging(kv, "disk", CollectorRegistry())


def test_host_mirror_is_what_nixl_registers() -> None:
    kv = _cache(0)
    staging = create_staging(kv, "cpu", CollectorRegistry())
    assert isinstance(staging, HostStaging)
    assert staging.mem_type == "DRAM" and staging.device_id == 0
    assert staging.layout == kv.layout and staging.nbytes == kv.nbytes
    assert staging.base_addr != kv.base_addr  # a separate buffer, not the cache itself
    assert staging.buffer.shape == kv.buffer.shape and staging.buffer.dtype == kv.buffer.dtype


@pytest.mark.parametrize("name", [BLOCK_MAJOR, LAYER_MAJOR])
def test_to_host_and_to_device_copy_exactly_the_given_blocks(name: str) -> None:
    registry = CollectorRegistry()
    layout = msgspec.structs.replace(LAYOUT, layout=name)
    sender, receiver = _cache(1, layout), _cache(2, layout)
    before = receiver.planes().clone()
    out = HostStaging(sender, registry)
    inn = HostStaging(receiver, CollectorRegistry())
    out_p, inn_p = planes_view(out.buffer, layout), planes_view(inn.buffer, layout)
    blocks = [2, 3, 4, 7]
    out.to_host(blocks)
    assert torch.equal(out_p[:, :, blocks], sender.planes()[:, :, blocks])
    others = [b for b in range(LAYOUT.num_blocks) if b not in blocks]
    assert not out_p[:, :, others].any()
    # "NIXL" moves sender mirror blocks [2,3,4,7] into receiver mirror blocks [0,1,5,6].
    dst = [0, 1, 5, 6]
    inn_p[:, :, dst] = out_p[:, :, blocks]
    assert torch.equal(receiver.planes(), before)  # nothing reaches the device before to_device
    inn.to_device(dst)
    assert torch.equal(receiver.planes()[:, :, dst], sender.planes()[:, :, blocks])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in dst]
    assert torch.equal(receiver.planes()[:, :, untouched], before[:, :, untouched])
    nbytes = len(blocks) * LAYOUT.num_layers * 2 * LAYOUT.block_bytes
    assert registry.get_sample_value("pdgate_shim_kv_staging_bytes_total",
                                     {"direction": "to_host"}) == nbytes
    assert registry.get_sample_value("pdgate_shim_kv_staging_seconds_count",
                                     {"direction": "to_host"}) == 1
