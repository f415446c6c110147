"""Side channel: a peer asks for this engine's NIXL agent metadata and KV geometry over ZMQ.

Server: a ROUTER socket on its own thread, bound to `--side-channel-port`; every request gets
the same `Envelope` (our version + the encoded `HandshakePayload`). Client: `fetch_handshake`
sends one request on a DEALER socket and waits at most `timeout` seconds for the reply.

Every frame is untrusted: its size is bounded before it is decoded (requests
`MAX_REQUEST_BYTES`, replies `MAX_REPLY_BYTES`; zmq disconnects a peer whose frame exceeds
`_ZMQ_MAX_FRAME`), and no frame can stop the server thread: a decode failure (including a
nesting bomb's RecursionError) is answered with an error envelope and counted, so the next
handshake is served as usual.

Decoding is two-phase: the envelope first (version check, lenient about unknown fields so a
newer peer still gets a clear version error), then the payload (strict). `validate_peer`
turns every mismatch (engine id, model, KV layout, compatibility hash) into a
`KVHandshakeError` naming the difference. This module does not import nixl.

Version history (SIDE_CHANNEL_VERSION):
  1: initial: engine_id, agent_name, agent_metadata, kv_base_addr, mem_type, device_id,
     layout (KVLayout), model_name, compat_hash.
  2: same handshake; the engines' NIXL notifications are typed `engine_shim.notices` frames
     (NOTICE_VERSION 1) instead of text, so a v1 peer (text notices) must not pair with us.
  3: same handshake; NOTICE_VERSION 2 (P's `failed` notice): a v2 peer would drop every
     notice of ours as another version, so it must not pair with us either.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import zmq

from pdgate.engine_shim.kv_layout import KVLayout
from pdgate.engine_shim.transfer_errors import KVConnectorError, KVHandshakeError

SIDE_CHANNEL_VERSION = 3
MAX_REQUEST_BYTES = 4096  # a HandshakeRequest is a version and an engine id: ~50 bytes
MAX_REPLY_BYTES = 16 << 20  # a payload is mostly NIXL agent metadata (KiBs)
_ZMQ_MAX_FRAME = 1 << 20  # the server's socket disconnects a peer sending a bigger frame
_POLL_MS = 100  # how often the server thread checks its stop flag
log = logging.getLogger(__name__)


class HandshakeRequest(msgspec.Struct, frozen=True):
    """What a client sends: its protocol version and engine id (for the server's logs)."""

    v: int
    engine_id: str = ""


class Envelope(msgspec.Struct, frozen=True):
    """Outer frame of every reply: decoded first, so a version mismatch is a clear error."""

    v: int
    payload: bytes = b""
    error: str = ""


class HandshakePayload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a reader needs to READ this engine's KV blocks. `kv_base_addr` is in the
    serving process's address space; `agent_name` changes on every engine start."""

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    kv_base_addr: int
    mem_type: str
    device_id: int
    layout: KVLayout
    model_name: str
    compat_hash: str


def compat_hash(model_name: str, layout: KVLayout) -> str:
    """SHA-256 over what must match for two engines to exchange blocks (not num_blocks)."""
    factors = {
        "v": SIDE_CHANNEL_VERSION, "model": model_name, "num_layers": layout.num_layers,
        "block_size": layout.block_size, "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim, "dtype": layout.dtype, "layout": layout.layout,
    }
    return hashlib.sha256(msgspec.json.encode(factors, order="sorted")).hexdigest()


def encode_reply(payload: HandshakePayload) -> bytes:
    body = msgspec.msgpack.encode(payload)
    return msgspec.msgpack.encode(Envelope(v=SIDE_CHANNEL_VERSION, payload=body))


def decode_reply(frame: bytes) -> HandshakePayload:
    """Two-phase decode of a server reply; raises KVHandshakeError on any problem."""
    if len(frame) > MAX_REPLY_BYTES:
        raise KVHandshakeError(f"handshake reply of {len(frame)} bytes is over "
                               f"{MAX_REPLY_BYTES}")
    try:
        env = msgspec.msgpack.decode(frame, type=Envelope)
    except (msgspec.DecodeError, RecursionError) as e:
        raise KVHandshakeError(f"malformed handshake envelope: {e}") from e
    if env.v != SIDE_CHANNEL_VERSION:
        raise KVHandshakeError(
            f"side-channel protocol version mismatch: local {SIDE_CHANNEL_VERSION}, "
            f"remote {env.v}")
    if env.error:
        raise KVHandshakeError(f"peer refused the handshake: {env.error}")
    try:
        return msgspec.msgpack.decode(env.payload, type=HandshakePayload)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise KVHandshakeError(f"malformed handshake payload: {e}") from e


def validate_peer(
    peer: HandshakePayload, *, engine_id: str, model_name: str, layout: KVLayout
) -> None:
    """Raise KVHandshakeError unless `peer` is engine `engine_id` serving blocks we can copy:
    same model and KV geometry as ours (`model_name`, `layout`; the block size may differ)."""
    if peer.engine_id != engine_id:
        raise KVHandshakeError(
            f"side channel answered as engine {peer.engine_id!r}, expected {engine_id!r}")
    if peer.model_name != model_name:
        raise KVHandshakeError(
            f"model differs: local {model_name!r} vs remote {peer.model_name!r}")
    why = layout.incompatibility(peer.layout)
    if why is not None:
        raise KVHandshakeError(f"KV layout incompatible with engine {engine_id!r}: {why}")
    # Block sizes may differ (transfers then map token ranges): hash with the peer's.
    if peer.compat_hash != compat_hash(model_name, peer.layout):
        raise KVHandshakeError(f"compatibility hash differs for engine {engine_id!r}")
    if peer.mem_type not in ("DRAM", "VRAM"):
        raise KVHandshakeError(f"unknown memory type {peer.mem_type!r}")


@contextmanager
def _socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> Iterator[zmq.Socket[bytes]]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        yield sock
    finally:
        sock.close(linger=0)


def fetch_handshake(
    host: str, port: int, timeout: float, *, engine_id: str = ""
) -> HandshakePayload:
    """Ask the side channel at host:port for its payload; blocking, at most `timeout` s.
    Raises KVHandshakeError on timeout or a bad reply (never hangs on a dead peer)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with _socket(ctx, zmq.DEALER) as sock:
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
            sock.connect(f"tcp://{host}:{port}")
            sock.send(msgspec.msgpack.encode(HandshakeRequest(SIDE_CHANNEL_VERSION, engine_id)))
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise KVHandshakeError(
                    f"no handshake reply from {host}:{port} within {timeout:.1f}s")
            return decode_reply(sock.recv())
    finally:
        ctx.term()


class SideChannelServer:
    """ROUTER thread answering handshakes with one fixed payload. `port=0` binds a free port
    (read `port` after `start`). `start` returns once bound (or raises KVConnectorError).
    `on_request(result)` is called from the server thread for every message, with result
    "served", "malformed_frames" (not one request frame), "malformed_request" (does not
    decode), "oversized" (over MAX_REQUEST_BYTES) or "internal" (a bug answering it), so
    junk on the port is counted."""

    def __init__(self, host: str, port: int, payload: HandshakePayload,
                 on_request: Callable[[str], None] | None = None) -> None:
        self.host = host
        self.port = port
        self._on_request = on_request or (lambda result: None)
        self._reply = encode_reply(payload)
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="kv-side-channel", daemon=True)

    def start(self, timeout: float = 5.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise KVConnectorError("side channel did not start in time")
        if self._error is not None:
            raise KVConnectorError(
                f"side channel cannot bind {self.host}:{self.port}: {self._error}"
            ) from self._error

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            with _socket(ctx, zmq.ROUTER) as sock:
                sock.setsockopt(zmq.MAXMSGSIZE, _ZMQ_MAX_FRAME)
                try:
                    sock.bind(f"tcp://{self.host}:{self.port}")
                    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
                    assert isinstance(endpoint, bytes)
                    self.port = int(endpoint.rsplit(b":", 1)[1])
                except zmq.ZMQError as e:
                    self._error = e
                    return
                finally:
                    self._ready.set()
                self._serve(sock)
        finally:
            ctx.term()

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        while not self._stop.is_set():
            if not sock.poll(_POLL_MS, zmq.POLLIN):
                continue
            try:
                self._answer(sock)
            except Exception:  # a dead thread would fail every later handshake
                log.exception("side channel: answering a message failed")
                self._on_request("internal")

    def _answer(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 2:
            self._on_request("malformed_frames")
            return  # not a DEALER request: nothing sensible to reply to
        identity, body = frames
        result, reply = self._reply_to(body)
        self._on_request(result)
        try:
            sock.send_multipart([identity, reply], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a full queue to a stuck peer must not stop the server
            log.warning("side channel reply dropped: %s", e)

    def _reply_to(self, body: bytes) -> tuple[str, bytes]:
        """(result, reply frame) for one request body."""
        if len(body) > MAX_REQUEST_BYTES:
            return "oversized", _error_reply("handshake request too large")
        try:
            req = msgspec.msgpack.decode(body, type=HandshakeRequest)
        # RecursionError: msgspec's answer to deep nesting, even inside skipped fields.
        except (msgspec.DecodeError, RecursionError, ValueError):
            return "malformed_request", _error_reply("malformed handshake request")
        log.debug("handshake request from engine %r (v%d)", req.engine_id, req.v)
        return "served", self._reply


def _error_reply(error: str) -> bytes:
    return msgspec.msgpack.encode(Envelope(v=SIDE_CHANNEL_VERSION, error=error))
