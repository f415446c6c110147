"""KV cache events over ZMQ in vLLM's format, so KV-aware routers that follow vLLM engines
(`--kv-events-config`) follow the shim too.

Wire (vLLM `ZmqEventPublisher`): PUB socket, 3-frame messages `[topic, seq (8-byte
big-endian, from 0), payload]`; payload = msgpack `KVEventBatch` encoded as the array
`[ts, events, data_parallel_rank]`, each event a map tagged by `"type"` (vLLM's current
encoding): `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name}`, `BlockRemoved {block_hashes, medium}`, `AllBlocksCleared {}`.
Block hashes are the shim's own (ints); consumers match on `token_ids`, as with vLLM.
Not implemented: vLLM's replay ROUTER socket (a subscriber that misses messages sees a
sequence gap and loses some cache hits, nothing else).

The socket is bound (the shim is the stable side; routers connect). `tcp://127.0.0.1:*`
binds a free port; `endpoint` then tells which. Used from the event-loop thread only; a send
never blocks (PUB drops at the high-water mark).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import msgspec
import zmq

from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.prefix_cache import BlockStoredEvent, CacheEvent

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch",
           "KVEventPublisher", "to_wire"]

log = logging.getLogger(__name__)

_MEDIUM = "GPU"  # what vLLM reports for its device cache; routers may filter on it
_HWM = 100_000


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = _MEDIUM
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None = _MEDIUM


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = 0


def to_wire(
    events: Sequence[CacheEvent], block_size: int
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The vLLM wire events of the prefix cache's events."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for ev in events:
        if isinstance(ev, BlockStoredEvent):
            out.append(BlockStored(list(ev.hashes), ev.parent, list(ev.token_ids), block_size))
        else:
            out.append(BlockRemoved(list(ev.hashes)))
    return out


class KVEventPublisher:
    """Binds a PUB socket on `start()`; `publish()` sends one batch; `close()` unbinds."""

    def __init__(self, endpoint: str, block_size: int, metrics: ShimMetrics,
                 topic: str = "") -> None:
        self._requested = endpoint
        self.endpoint = endpoint
        self._block_size = block_size
        self._metrics = metrics
        self._topic = topic.encode()
        self._seq = itertools.count()
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None

    def start(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        try:
            sock.bind(self._requested)
        except zmq.ZMQError:
            sock.close(linger=0)
            ctx.term()
            raise
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ctx, self._sock = ctx, sock
        log.info("publishing KV cache events on %s", self.endpoint)

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Send `events` as one batch (nothing when empty or not started)."""
        if not events or self._sock is None:
            return
        wire = to_wire(events, self._block_size)
        payload = self._encode(KVEventBatch(time.time(), wire))
        seq = next(self._seq).to_bytes(8, "big")
        try:
            self._sock.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV event batch dropped (subscribers too slow)")
            return
        for ev in wire:
            self._metrics.kv_events_published.labels(type(ev).__name__).inc()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
