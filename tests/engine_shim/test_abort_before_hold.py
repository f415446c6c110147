"""An abort that overtakes its prefill's hand-over: the router gave up on a pull-mode
prefill (its client left) while P was finishing it, so P sees the abort before it leases
the prompt's blocks. The lease must not be taken (it would pin the blocks until it
expired, 60 s here): P answers without `kv_transfer_params` and its pool is full again at
once. A request that was not aborted still gets its lease."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdgate.engine_shim.cli import ConnectorSettings, nixl_connector_factory
from tests.engine_shim.live import MODEL, Shim, start_shim, stop_shim


@pytest.fixture(scope="module")
def prefill(tiny_model_dir: Path) -> Iterator[Shim]:
    factory = nixl_connector_factory(ConnectorSettings(
        engine_id="p-abort", side_channel_host="127.0.0.1", side_channel_port=0,
        lease_seconds=60.0))
    shim = start_shim(tiny_model_dir, connector_factory=factory)
    yield shim
    stop_shim(shim)


def _prefill(shim: Shim, rid: str) -> dict[str, Any]:
    r = shim.post("/v1/completions", {
        "model": MODEL, "prompt": "Paged attention stores keys and values in blocks.",
        "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_prefill_aborted_before_its_hand_over_leases_nothing(prefill: Shim) -> None:
    assert prefill.post("/v1/kv/abort", {"request_id": "gone-1"}).status_code == 200
    reply = _prefill(prefill, "gone-1")
    assert reply.get("kv_transfer_params") is None  # nobody will read it: nothing pinned
    assert prefill.metric("pdgate_shim_kv_blocks_leased") == 0
    prefill.wait_pool_full()

    kept = _prefill(prefill, "kept-1")
    assert kept["kv_transfer_params"]["remote_block_ids"]
    assert prefill.metric("pdgate_shim_kv_blocks_leased") > 0
    assert prefill.post("/v1/kv/abort", {"request_id": "kept-1"}).status_code == 200
    assert prefill.metric("pdgate_shim_kv_blocks_leased") == 0
    prefill.wait_pool_full()
