"""KV block transfer between two shim connectors in two processes over real NIXL (UCX, DRAM).

A prefill-side ("P") connector runs in a spawned process with a real `PagedKVCache` filled with
known values and a real `BlockPool`; the decode side ("D") runs in the test process. The test
drives P through a pipe (hold blocks, read its bytes, report its pool and metrics).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest
import torch
from prometheus_client import CollectorRegistry

from pdgate.engine_shim.connector import (
    KVConnector,
    KVConnectorError,
    KVHandshakeError,
    KVTransferError,
)
from pdgate.engine_shim.kv_cache import BlockPool, PagedKVCache
from pdgate.engine_shim.kv_layout import BLOCK_MAJOR, LAYER_MAJOR, KVLayout
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.side_channel import SIDE_CHANNEL_VERSION, Envelope, decode_reply

MODEL = "tiny-llama"
LAYOUT = KVLayout(num_layers=2, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=16)
# Bytes of one block across all layers and K/V: what a pull of one block moves.
BLOCK_ALL_LAYERS = LAYOUT.block_bytes * LAYOUT.num_layers * 2


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads), from /proc."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p_command(cmd: tuple[Any, ...], conn: KVConnector, kv: PagedKVCache, pool: BlockPool,
               metrics: ShimMetrics) -> Any:
    op = cmd[0]
    if op == "hold":
        return conn.hold_for_remote_decode(cmd[1], pool.allocate(cmd[2]))
    if op == "abort":
        return conn.abort(cmd[1])
    if op == "blocks":  # the bytes of these blocks in every (layer, K|V)
        return kv.planes()[:, :, list(cmd[1])].contiguous().view(torch.uint8).numpy().tobytes()
    if op == "state":
        reg = metrics.registry
        return {
            "free": pool.num_free, "leased": conn.leased_blocks(),
            "released": reg.get_sample_value("pdgate_shim_kv_leases_released_total"),
            "expired": reg.get_sample_value("pdgate_shim_kv_leases_expired_total"),
        }
    if op == "idle_cpu":
        c0 = cpu_seconds()
        time.sleep(cmd[1])
        return cpu_seconds() - c0
    raise ValueError(op)


def serve_p(pipe: Connection, engine_id: str, layout: KVLayout, lease_seconds: float) -> None:
    """P process: a started connector over a KV cache of known values; answers `pipe`."""
    kv = PagedKVCache(layout, "cpu")
    kv.buffer.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(7)))
    pool = BlockPool(layout.num_blocks)
    metrics = ShimMetrics.create(CollectorRegistry())
    conn = KVConnector(
        engine_id=engine_id, model_name=MODEL, kv=kv, side_channel_host="127.0.0.1",
        side_channel_port=0, lease_seconds=lease_seconds, free_blocks=pool.free, metrics=metrics,
    )
    conn.start()
    pipe.send(conn.side_channel_port)
    try:
        while True:
            cmd = pipe.recv()
            if cmd[0] == "stop":
                break
            pipe.send(_p_command(cmd, conn, kv, pool, metrics))
    finally:
        conn.close()
        pipe.send(pool.num_free)


@dataclass
class PeerProcess:
    proc: mp.process.BaseProcess
    pipe: Connection
    port: int

    def ask(self, *cmd: Any) -> Any:
        self.pipe.send(cmd)
        if not self.pipe.poll(30):
            raise TimeoutError(f"P process did not answer {cmd[0]!r}")
        return self.pipe.recv()

    def wait_state(self, key: str, want: Any, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            state: dict[str, Any] = self.ask("state")
            if state[key] == want or time.monotonic() > deadline:
                return state
            time.sleep(0.02)


def _spawn_p(engine_id: str, layout: KVLayout, lease_seconds: float) -> PeerProcess:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_p, args=(child, engine_id, layout, lease_seconds),
                       daemon=True)
    proc.start()
    if parent not in mp.connection.wait([parent, proc.sentinel], 60):
        proc.kill()
        raise RuntimeError(f"P process did not start (exit code {proc.exitcode})")
    return PeerProcess(proc, parent, parent.recv())


def _stop_p(p: PeerProcess) -> int | None:
    """Stop P cleanly; returns its pool's free-block count after close (None if it died)."""
    free = None
    if p.proc.is_alive():
        p.pipe.send(("stop",))
        free = p.pipe.recv() if p.pipe.poll(30) else None
        p.proc.join(10)
    if p.proc.is_alive():
        p.proc.kill()
        p.proc.join(5)
    return free


@pytest.fixture(scope="module")
def prefill() -> Iterator[PeerProcess]:
    p = _spawn_p("prefill-0", LAYOUT, lease_seconds=60.0)
    yield p
    assert _stop_p(p) == LAYOUT.num_blocks  # close() freed whatever was still leased


@pytest.fixture
def decode() -> Iterator[tuple[KVConnector, PagedKVCache, ShimMetrics]]:
    yield from _decode(LAYOUT)


def _decode(layout: KVLayout) -> Iterator[tuple[KVConnector, PagedKVCache, ShimMetrics]]:
    kv = PagedKVCache(layout, "cpu")
    metrics = ShimMetrics.create(CollectorRegistry())
    conn = KVConnector(
        engine_id="decode-0", model_name=MODEL, kv=kv, side_channel_host="127.0.0.1",
        side_channel_port=0, lease_seconds=60.0, free_blocks=lambda ids: None, metrics=metrics,
        transfer_timeout=5.0, handshake_timeout=2.0,
    )
    conn.start()
    try:
        yield conn, kv, metrics
    finally:
        conn.close()


def _local_bytes(kv: PagedKVCache, ids: list[int]) -> bytes:
    return kv.planes()[:, :, ids].contiguous().view(torch.uint8).numpy().tobytes()


async def test_pull_copies_exact_bytes_and_notice_frees_p_blocks(
    prefill: PeerProcess, decode: tuple[KVConnector, PagedKVCache, ShimMetrics]
) -> None:
    conn, kv, metrics = decode
    params = prefill.ask("hold", "req-1", 5)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-0" and params["tp_size"] == 1
    assert params["remote_request_id"] == "req-1"
    remote = params["remote_block_ids"]
    assert prefill.ask("state")["leased"] == 5
    local = [10, 11, 12, 2, 20]  # a run, then two single blocks: three coalesced runs
    nbytes = await asyncio.wait_for(conn.pull(params, local), 30)
    assert nbytes == 5 * BLOCK_ALL_LAYERS
    assert _local_bytes(kv, local) == prefill.ask("blocks", remote)
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in local]
    assert not kv.planes()[:, :, untouched].any()  # nothing outside the target blocks written
    state = prefill.wait_state("leased", 0)
    assert state["leased"] == 0 and state["free"] == LAYOUT.num_blocks
    assert state["released"] == 1 and state["expired"] == 0
    reg = metrics.registry
    assert reg.get_sample_value("pdgate_shim_kv_transfer_bytes_total", {"op": "read"}) == nbytes
    assert reg.get_sample_value("pdgate_shim_handshakes_total", {"result": "ok"}) == 1


async def test_second_pull_reuses_handshake(
    prefill: PeerProcess, decode: tuple[KVConnector, PagedKVCache, ShimMetrics]
) -> None:
    conn, kv, metrics = decode
    for i, local in enumerate(([0, 1, 2], [7, 8, 9])):
        params = prefill.ask("hold", f"again-{i}", 3)
        await asyncio.wait_for(conn.pull(params, local), 30)
        assert _local_bytes(kv, local) == prefill.ask("blocks", params["remote_block_ids"])
    assert metrics.registry.get_sample_value(
        "pdgate_shim_handshakes_total", {"result": "ok"}) == 1
    assert prefill.wait_state("leased", 0)["free"] == LAYOUT.num_blocks


def test_abort_frees_every_lease_of_the_request(prefill: PeerProcess) -> None:
    first = prefill.ask("hold", "abort-me", 4)
    second = prefill.ask("hold", "abort-me", 1)  # a retried prefill under the same id
    assert first["remote_request_id"] == "abort-me"
    assert second["remote_request_id"] != "abort-me"
    assert prefill.ask("state")["leased"] == 5
    prefill.ask("abort", "abort-me")
    state = prefill.ask("state")
    assert state["leased"] == 0 and state["free"] == LAYOUT.num_blocks


async def test_bad_params_raise_transfer_error(
    prefill: PeerProcess, decode: tuple[KVConnector, PagedKVCache, ShimMetrics]
) -> None:
    conn, _, _ = decode
    params = prefill.ask("hold", "bad", 2)
    with pytest.raises(KVTransferError, match="2 remote blocks but 3 local"):
        await conn.pull(params, [0, 1, 2])
    with pytest.raises(KVTransferError, match="remote_port"):
        await conn.pull({**params, "remote_port": "x"}, [0, 1])
    with pytest.raises(KVTransferError, match="local block ids"):
        await conn.pull(params, [0, LAYOUT.num_blocks])
    await asyncio.wait_for(conn.pull(params, [0, 1]), 30)  # the lease is still good


async def test_incompatible_layout_is_a_handshake_error(prefill: PeerProcess) -> None:
    # (block sizes may differ: tests/engine_shim/test_block_mapping.py)
    other = KVLayout(num_layers=2, num_blocks=32, block_size=16, num_kv_heads=4, head_dim=16)
    params = prefill.ask("hold", "mismatch", 1)
    for conn, _, metrics in _decode(other):
        with pytest.raises(KVHandshakeError, match="num_kv_heads differs: local 4 vs remote 2"):
            await asyncio.wait_for(conn.pull(params, [0]), 30)
        assert metrics.registry.get_sample_value(
            "pdgate_shim_kv_transfer_failures_total", {"op": "read", "reason": "handshake"}) == 1


async def test_layer_major_engines_pull_and_refuse_a_block_major_peer() -> None:
    """The layer-major layout (`--kv-layout layer`) still moves exact bytes; P and D must
    agree on the layout (the default, block-major, is what every other test here uses)."""
    layer = msgspec.structs.replace(LAYOUT, layout=LAYER_MAJOR)
    p = _spawn_p("prefill-layer", layer, lease_seconds=60.0)
    try:
        params = p.ask("hold", "layer-1", 4)
        for conn, kv, _ in _decode(layer):
            local = [3, 4, 9, 10]
            assert await asyncio.wait_for(conn.pull(params, local), 30) == 4 * BLOCK_ALL_LAYERS
            assert _local_bytes(kv, local) == p.ask("blocks", params["remote_block_ids"])
        params = p.ask("hold", "block-1", 1)
        for conn, _, _ in _decode(LAYOUT):
            with pytest.raises(KVHandshakeError, match=f"layout differs: local {BLOCK_MAJOR!r}"):
                await asyncio.wait_for(conn.pull(params, [0]), 30)
        assert p.wait_state("leased", 1)["leased"] == 1  # the refused pull read nothing
    finally:
        assert _stop_p(p) == layer.num_blocks


async def test_lease_expiry_frees_unread_blocks_and_dead_peer_fails_fast(
    decode: tuple[KVConnector, PagedKVCache, ShimMetrics]
) -> None:
    conn, _, _ = decode
    p = _spawn_p("prefill-short", LAYOUT, lease_seconds=0.5)
    try:
        p.ask("hold", "nobody-reads", 3)
        p.wait_state("expired", 1)
        # The expiry is counted, then its blocks go back: a read in between sees both.
        state = p.wait_state("leased", 0)
        assert state["expired"] == 1 and state["leased"] == 0
        assert state["free"] == LAYOUT.num_blocks and state["released"] == 0
        params = p.ask("hold", "read-then-die", 2)
        await asyncio.wait_for(conn.pull(params, [4, 5]), 30)  # handshaken and cached
        params = p.ask("hold", "never-read", 2)
    finally:
        p.proc.kill()
        p.proc.join(10)
    # Cached peer is gone: the read fails, the re-handshake times out, pull raises in time.
    with pytest.raises(KVTransferError):
        await asyncio.wait_for(conn.pull(params, [6, 7]), 30)


async def test_pull_from_nowhere_fails_within_deadline(
    decode: tuple[KVConnector, PagedKVCache, ShimMetrics]
) -> None:
    conn, _, _ = decode
    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "ghost",
        "remote_request_id": "r", "remote_block_ids": [0], "remote_host": "127.0.0.1",
        "remote_port": _free_port(), "tp_size": 1,
    }
    with pytest.raises(KVHandshakeError, match="no handshake reply"):
        await asyncio.wait_for(conn.pull(params, [0]), 30)


async def test_restarted_peer_is_handshaken_again(
    decode: tuple[KVConnector, PagedKVCache, ShimMetrics], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdgate.engine_shim.connector_pull")
    conn, kv, metrics = decode
    reg = metrics.registry
    old = _spawn_p("prefill-r", LAYOUT, lease_seconds=60.0)
    try:
        await asyncio.wait_for(conn.pull(old.ask("hold", "a", 2), [0, 1]), 30)
    finally:
        old.proc.kill()
        old.proc.join(10)
    for strip_agent_name in (False, True):
        new = _spawn_p("prefill-r", LAYOUT, lease_seconds=60.0)  # same engine id, new agent
        try:
            params = new.ask("hold", "b", 3)
            if strip_agent_name:  # as from a vLLM P: D learns of the restart by a failed read
                del params["remote_agent_name"]
            await asyncio.wait_for(conn.pull(params, [5, 6, 7]), 30)
            assert _local_bytes(kv, [5, 6, 7]) == new.ask("blocks", params["remote_block_ids"])
            assert new.wait_state("leased", 0)["released"] == 1
        finally:
            _stop_p(new)
    assert reg.get_sample_value("pdgate_shim_handshakes_total", {"result": "ok"}) == 3
    assert reg.get_sample_value("pdgate_shim_kv_transfers_total", {"op": "read"}) == 3
    assert reg.get_sample_value(  # the pull that found out by failing still succeeded
        "pdgate_shim_kv_transfer_failures_total", {"op": "read", "reason": "transfer"}) is None
    # The failed read is a WARNING, the recovery an INFO.
    said = [(r.levelno, r.getMessage()) for r in caplog.records
            if "re-handshaking" in r.getMessage() or "recovered" in r.getMessage()]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO], said


async def test_pull_does_not_block_the_event_loop(
    prefill: PeerProcess, decode: tuple[KVConnector, PagedKVCache, ShimMetrics]
) -> None:
    conn, _, _ = decode
    params = prefill.ask("hold", "loop", 8)
    ticks = 0
    pull = asyncio.ensure_future(conn.pull(params, list(range(8))))
    while not pull.done():
        ticks += 1
        await asyncio.sleep(0)
    assert pull.result() == 8 * BLOCK_ALL_LAYERS
    assert ticks > 1  # the loop kept running other tasks during the handshake and the read


def test_side_channel_port_in_use_fails_start_cleanly() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        conn = KVConnector(
            engine_id="clash", model_name=MODEL, kv=PagedKVCache(LAYOUT, "cpu"),
            side_channel_host="127.0.0.1", side_channel_port=taken.getsockname()[1],
            lease_seconds=1.0, free_blocks=lambda ids: None,
            metrics=ShimMetrics.create(CollectorRegistry()),
        )
        with pytest.raises(KVConnectorError, match="cannot bind"):
            conn.start()
    conn.close()  # idempotent after a failed start


def test_handshake_version_mismatch_and_garbage_are_clear_errors() -> None:
    newer = msgspec.msgpack.encode(Envelope(v=SIDE_CHANNEL_VERSION + 1, payload=b"?"))
    with pytest.raises(KVHandshakeError, match="protocol version mismatch"):
        decode_reply(newer)
    with pytest.raises(KVHandshakeError, match="malformed handshake envelope"):
        decode_reply(b"\x00not msgpack")
    with pytest.raises(KVHandshakeError, match="malformed handshake payload"):
        decode_reply(msgspec.msgpack.encode(Envelope(v=SIDE_CHANNEL_VERSION, payload=b"x")))


def test_idle_agent_uses_almost_no_cpu(prefill: PeerProcess) -> None:
    # nixl's default progress thread would burn ~1 CPU-second per second here.
    assert prefill.ask("idle_cpu", 2.0) < 0.2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
