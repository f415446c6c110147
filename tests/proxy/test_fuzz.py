"""Random and malformed frames at the KV-ready proxy: dropped and counted, never a crash."""

from __future__ import annotations

import asyncio

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdgate.proxy import NotifyServer, ProxyConfig
from pdgate.proxy.wire import FrameDecoder, KVReady, WireError, to_frames

SECRET = b"fuzz-secret-fuzz-secret"

# Frames that look like ours often enough to reach the second decoding phase.
_maps = st.dictionaries(
    st.sampled_from(["v", "kind", "request_id", "req_id", "engine_id", "status", "ts", "x",
                     "token"]),
    st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=8), st.none(),
              st.binary(max_size=8)),
    max_size=6,
)
# Nesting deeper than the recursion limit, alone or as a field the envelope skips.
_bombs = st.integers(500, 5000).flatmap(lambda n: st.sampled_from([
    b"\x91" * n + b"\x01",
    b"\x82\xa1v\x02\xa1x" + b"\x91" * n + b"\x01",
    b'{"v": 2, "x": ' + b"[" * n + b"]" * n + b"}",
    b'{"req_id": ' + b"[" * n + b"]" * n + b"}",
]))
_frame = st.one_of(st.binary(max_size=64), _maps.map(msgspec.msgpack.encode),
                   _maps.map(msgspec.json.encode), _bombs)


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(_frame, min_size=0, max_size=3), signed=st.booleans())
def test_decoder_only_ever_returns_a_message_or_raises_wire_error(
    frames: list[bytes], signed: bool
) -> None:
    decoder = FrameDecoder(SECRET if signed else None)
    try:
        kind, msg = decoder.decode(frames)
    except WireError as e:
        assert e.reason in {"malformed", "too_large", "bad_version", "unknown_kind", "bad_mac"}
        return
    assert isinstance(kind, str)
    assert not signed, "an unsigned random frame passed the HMAC check"
    assert msg is not None


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(st.lists(_frame, min_size=1, max_size=3), min_size=1, max_size=20))
def test_live_server_survives_random_frames_and_still_wakes_waiters(
    batch: list[list[bytes]],
) -> None:
    asyncio.run(_send_batch_then_a_real_notification(batch))


async def _send_batch_then_a_real_notification(batch: list[list[bytes]]) -> None:
    import zmq
    import zmq.asyncio

    server = NotifyServer(ProxyConfig(bind="tcp://127.0.0.1:0", notify_secret=SECRET.decode()))
    await server.start()
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(server.endpoint)
    try:
        for frames in batch:
            await push.send_multipart(frames)
        server.waiters.register("real")
        await push.send_multipart(to_frames(KVReady(request_id="real"), SECRET))
        assert (await server.waiters.wait("real", timeout=10)).request_id == "real"
        # Every random frame was unsigned: none may have woken or created anything.
        assert server.frames_received == len(batch) + 1
        assert server.waiters.early_count() == 0
    finally:
        push.close(linger=0)
        ctx.term()
        await server.close()
