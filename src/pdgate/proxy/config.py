"""`ProxyConfig`: every setting of the KV-ready proxy, validated once at startup."""

from __future__ import annotations

import msgspec

from pdgate.proxy.wire import MAX_FRAME_BYTES


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Settings of one proxy (one PULL socket and its waiter table).

    Fields:
        bind: zmq endpoint to bind, e.g. ``tcp://0.0.0.0:7500``; port 0 (or ``*``) picks a
            free port, read it back from `NotifyServer.endpoint`.
        advertise_host: host engines should connect to when `bind` uses a wildcard host;
            `NotifyServer.advertised_endpoint` substitutes it.
        notify_secret: shared secret for HMAC-SHA256 frame signatures; when set, unsigned or
            badly signed frames are dropped.
        ttl_s: lifetime of unclaimed early arrivals and never-awaited waiters (seconds).
        reap_interval_s: how often the reaper runs (seconds).
        max_waiters: registered waiters allowed at once (register raises beyond).
        max_early / max_early_bytes: caps on held early arrivals (count, payload bytes).
        rcv_hwm: zmq receive high-water mark: messages queued per connected peer. It bounds
            what one flooding connection of ordinary messages holds in memory (about
            ``rcv_hwm * max_msg_bytes``; zmq does not bound the frames of one message);
            fair queueing, not the queue depth, is what keeps real notices flowing.
        max_msg_bytes: zmq MAXMSGSIZE; a peer sending a bigger frame is disconnected.
        max_frame_bytes: largest payload frame decoded; a bigger one is dropped and counted
            (``too_large``) before its MAC is computed. Sizes between this and
            `max_msg_bytes` are counted drops, bigger ones disconnects.
        batch: messages handled per event-loop turn before yielding to woken waiters.
        batch_time_s: time budget of one turn (seconds); the turn ends at whichever of
            `batch` and this comes first, so a flood of costly junk cannot hold the loop.
    """

    bind: str = "tcp://127.0.0.1:7500"
    advertise_host: str | None = None
    notify_secret: str | None = None
    ttl_s: float = 60.0
    reap_interval_s: float = 1.0
    max_waiters: int = 100_000
    max_early: int = 100_000
    max_early_bytes: int = 64 << 20
    rcv_hwm: int = 1_000
    max_msg_bytes: int = 64 << 10
    max_frame_bytes: int = MAX_FRAME_BYTES
    batch: int = 64
    batch_time_s: float = 0.002

    def validate(self) -> ProxyConfig:
        """Return self, or raise ValueError naming the first bad field."""
        if "://" not in self.bind:
            raise ValueError(f"bind: not a zmq endpoint: {self.bind!r}")
        if self.notify_secret is not None and len(self.notify_secret) < 16:
            raise ValueError("notify_secret: use at least 16 characters")
        for name in ("ttl_s", "reap_interval_s", "batch_time_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        for name in ("max_waiters", "max_early", "max_early_bytes", "rcv_hwm",
                     "max_msg_bytes", "max_frame_bytes", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        return self

    def secret_bytes(self) -> bytes | None:
        """The HMAC key, or None when frames are not authenticated."""
        return None if self.notify_secret is None else self.notify_secret.encode()
