"""KV-ready notifications: prefill engines tell the router that a request's KV is in place.

Reading path: `wire` (the message contract, pure data) → `waiters` (per-request waiters and
early arrivals) → `server` (zmq PULL socket feeding the waiters) → `sender` (engine side).

Router side::

    async with NotifyServer(ProxyConfig(bind="tcp://0.0.0.0:0", advertise_host=my_ip)) as px:
        notify_to = px.advertised_endpoint       # goes in the prefill leg's kv_transfer_params
        token = secrets.token_hex(16)            # ... and so does this, as "notify_token"
        px.waiters.register(request_id, token=token)  # BEFORE dispatching the prefill
        ...dispatch prefill...
        ready = await px.waiters.wait(request_id, timeout=10.0)  # KVReady, or raises
        # px.waiters.cancel(request_id) if the request is abandoned before waiting

Engine side (echo the token it was given, "" if none)::

    with NotifySender(secret=...) as sender:
        sender.send(notify_to, KVReady(request_id=rid, engine_id=eid, num_tokens=n,
                                       token=params.get("notify_token", "")))

Trust model: the port is open to anyone who can reach it. The shared secret (HMAC) keeps out
notices no engine signed; the per-request token keeps out notices an engine signed for
someone else's request (anyone who can send a prefill can get one); each waiter accepts one
notice, so a captured one cannot be replayed. Junk of any shape is a counted drop that costs
microseconds and cannot stop the receive loop (proxy.wire, proxy.server).

Imports nothing from router or engine_shim.
"""

from __future__ import annotations

from pdgate.proxy.config import ProxyConfig
from pdgate.proxy.errors import (
    KVReadyTimeout,
    KVTransferFailed,
    ProxyError,
    WaitCancelled,
    WaiterLimitExceeded,
)
from pdgate.proxy.metrics import ProxyMetrics
from pdgate.proxy.sender import NotifySender
from pdgate.proxy.server import NotifyServer
from pdgate.proxy.waiters import WaiterTable
from pdgate.proxy.wire import (
    PROTOCOL_VERSION,
    FrameDecoder,
    Heartbeat,
    KVReady,
    Message,
    WireError,
    to_frames,
)

__all__ = [
    "PROTOCOL_VERSION",
    "FrameDecoder",
    "Heartbeat",
    "KVReady",
    "KVReadyTimeout",
    "KVTransferFailed",
    "Message",
    "NotifySender",
    "NotifyServer",
    "ProxyConfig",
    "ProxyError",
    "ProxyMetrics",
    "WaitCancelled",
    "WaiterLimitExceeded",
    "WaiterTable",
    "WireError",
    "to_frames",
]
