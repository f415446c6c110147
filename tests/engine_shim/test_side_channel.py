"""The NIXL side channel survives hostile bytes (engine_shim/side_channel.py).

A live connector's side channel gets a msgpack nesting bomb (msgspec raises RecursionError,
which used to escape the server loop and kill its thread, so every later handshake timed
out), a frame over the request bound, and a frame over zmq's limit; each is refused (an
error envelope, or zmq dropping the peer) and counted, and a normal handshake still works.
The client side refuses bombs and oversized replies the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from pdgate.engine_shim.connector import KVConnector
from pdgate.engine_shim.kv_cache import PagedKVCache
from pdgate.engine_shim.kv_layout import KVLayout
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.side_channel import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    SIDE_CHANNEL_VERSION,
    Envelope,
    KVHandshakeError,
    decode_reply,
    fetch_handshake,
)

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=16)
BOMB = b"\x91" * 3000 + b"\x01"  # 3000 nested one-element arrays: under the size bound
# A valid-looking request whose unknown field msgspec must skip: the skip recurses too.
BOMB_IN_FIELD = b"\x82\xa1v\x02\xa1x" + BOMB
BIG_BOMB = b"\x91" * 200_000 + b"\x01"


@pytest.fixture
def live() -> Iterator[tuple[KVConnector, ShimMetrics]]:
    metrics = ShimMetrics.create(CollectorRegistry())
    conn = KVConnector(engine_id="p-hostile", model_name="m", kv=PagedKVCache(LAYOUT, "cpu"),
                       side_channel_host="127.0.0.1", side_channel_port=0, lease_seconds=60,
                       free_blocks=lambda ids: None, metrics=metrics, handshake_timeout=5.0)
    conn.start()
    try:
        yield conn, metrics
    finally:
        conn.close()


def _ask(port: int, frame: bytes, timeout_ms: int = 5000) -> bytes | None:
    """Send one raw request frame; the reply frame, or None when none came."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(frame)
        reply = sock.recv() if sock.poll(timeout_ms, zmq.POLLIN) else None
        sock.close(linger=0)
        return reply
    finally:
        ctx.term()


def _count(metrics: ShimMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value(
        "pdgate_shim_protocol_errors_total",
        {"channel": "side_channel", "reason": reason}) or 0.0


def test_nesting_bombs_and_oversized_frames_leave_the_side_channel_serving(
    live: tuple[KVConnector, ShimMetrics],
) -> None:
    conn, metrics = live
    port = conn.side_channel_port
    for bomb in (BOMB, BOMB_IN_FIELD):
        reply = _ask(port, bomb)
        assert reply is not None, "the side channel thread died"
        with pytest.raises(KVHandshakeError, match="malformed handshake request"):
            decode_reply(reply)
    for big in (b"\x00" * (MAX_REQUEST_BYTES + 1), BIG_BOMB):  # refused before decoding
        reply = _ask(port, big)
        assert reply is not None
        with pytest.raises(KVHandshakeError, match="too large"):
            decode_reply(reply)
    # Over zmq's frame limit: the peer is disconnected before the frame is buffered.
    assert _ask(port, b"\x00" * (8 << 20), timeout_ms=1000) is None
    assert _count(metrics, "malformed") == 2 and _count(metrics, "oversized") == 2
    # Still serving: a normal handshake gets the payload.
    payload = fetch_handshake("127.0.0.1", port, 5.0, engine_id="d")
    assert payload.engine_id == "p-hostile" and payload.agent_name == conn.agent_name
    assert metrics.registry.get_sample_value(
        "pdgate_shim_handshakes_total", {"result": "side_channel_served"}) == 1


def test_hostile_replies_are_handshake_errors() -> None:
    with pytest.raises(KVHandshakeError, match="malformed handshake envelope"):
        decode_reply(BIG_BOMB)
    env = msgspec.msgpack.encode(Envelope(v=SIDE_CHANNEL_VERSION, payload=BIG_BOMB))
    with pytest.raises(KVHandshakeError, match="malformed handshake payload"):
        decode_reply(env)
    with pytest.raises(KVHandshakeError, match="over"):
        decode_reply(b"\x00" * (MAX_REPLY_BYTES + 1))


@pytest.mark.parametrize("old_version", [1, 2])
def test_an_older_peer_gets_a_version_error(old_version: int) -> None:
    """v2 changed the NIXL notification format, v3 added P's `failed` notice (NOTICE_VERSION
    2): engines of different versions must not pair."""
    old = msgspec.msgpack.encode(Envelope(v=old_version, payload=b""))
    with pytest.raises(KVHandshakeError,
                       match=f"version mismatch: local 3, remote {old_version}"):
        decode_reply(old)
