"""`NotifySender`: the engine side of KV-ready notifications (zmq PUSH, never blocks).

The prefill engine learns the router proxy's endpoint from the request's
kv_transfer_params and calls ``sender.send(endpoint, KVReady(...))`` once the KV is in place
(or the transfer failed). One PUSH socket per endpoint, kept for reuse; the least recently
used is closed beyond `max_peers`. Synchronous zmq with NOBLOCK, so it is safe to call from
an event loop; not thread-safe (use it from one thread).
"""

from __future__ import annotations

from collections import OrderedDict
from types import TracebackType

import zmq

from pdgate.proxy.wire import Message, to_frames


class NotifySender:
    """Sends KV-ready messages, optionally signed with the shared secret.

    Args:
        secret: HMAC key (same as the proxy's ``--notify-secret``), or None.
        context: zmq context to use; a private one (terminated on close) when omitted.
        max_peers: connected endpoints kept open at once.
        sndhwm: messages queued per endpoint (e.g. while connecting) before `send` drops.
    """

    def __init__(
        self, *, secret: bytes | str | None = None, context: zmq.Context[zmq.Socket[bytes]] |
        None = None, max_peers: int = 64, sndhwm: int = 10_000,
    ) -> None:
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._own_ctx = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None \
            else zmq.Context()
        self._max_peers = max_peers
        self._sndhwm = sndhwm
        self._socks: OrderedDict[str, zmq.Socket[bytes]] = OrderedDict()

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue `msg` for the proxy at `endpoint` (e.g. ``tcp://10.0.0.5:7500``).

        Returns False, without blocking, when the endpoint's queue is full; the waiter on
        the router side then times out. Connecting is asynchronous: a message sent before
        the TCP connection is up is queued and delivered once it is.
        """
        sock = self._socket(endpoint)
        try:
            sock.send_multipart(to_frames(msg, self._secret), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        """Close every socket with linger 0 (queued messages are dropped) and the context."""
        while self._socks:
            _, sock = self._socks.popitem()
            sock.close(linger=0)
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> NotifySender:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _socket(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._socks.get(endpoint)
        if sock is not None:
            self._socks.move_to_end(endpoint)
            return sock
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        sock.connect(endpoint)
        self._socks[endpoint] = sock
        if len(self._socks) > self._max_peers:
            _, old = self._socks.popitem(last=False)
            old.close(linger=0)
        return sock
