"""NotifyServer over real zmq sockets on loopback: wake-ups, bad frames, caps, reaper."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from pdgate.proxy import (
    KVReady,
    KVReadyTimeout,
    KVTransferFailed,
    NotifySender,
    NotifyServer,
    ProxyConfig,
)
from pdgate.proxy.wire import encode, sign, to_frames
from tests.proxy.conftest import SECRET, ServerFactory, eventually, sample

MSGS = "pdgate_proxy_messages_total"
RawPush = Callable[[str], zmq.Socket[bytes]]


REJECTED = "pdgate_proxy_notifications_rejected_total"
TOKEN = "5a" * 16


def ok(rid: str) -> KVReady:
    return KVReady(request_id=rid, engine_id="p0", num_tokens=16, num_blocks=1)


def signed(payload: bytes, secret: str | None) -> list[bytes]:
    """`payload` as a sender holding `secret` would frame it (a bomb with a valid MAC)."""
    return [payload] if secret is None else [payload, sign(payload, secret.encode())]


def json_bomb(depth: int) -> bytes:
    return b'{"v": 2, "kind": "kv_ready", "x": ' + b"[" * depth + b"]" * depth + b"}"


def msgpack_bomb(depth: int) -> bytes:
    head = msgspec.msgpack.encode({"v": 2, "kind": "kv_ready", "request_id": "r"})
    return bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode("x") + b"\x91" * depth + b"\x01"


async def test_wait_before_notify(server: NotifyServer, sender: NotifySender) -> None:
    server.waiters.register("r1")
    task = asyncio.create_task(server.waiters.wait("r1", timeout=10))
    assert sender.send(server.endpoint, ok("r1"))
    msg = await task
    assert (msg.request_id, msg.num_tokens) == ("r1", 16)
    assert sample(server, MSGS, kind="kv_ready", result="ok") == 1
    assert server.waiters.waiter_count() == 0


async def test_notify_before_wait(server: NotifyServer, sender: NotifySender) -> None:
    sender.send(server.endpoint, ok("r1"))
    await eventually(lambda: server.waiters.early_count() == 1)
    assert (await server.waiters.wait("r1", timeout=10)).request_id == "r1"
    assert server.waiters.early_count() == 0


async def test_deadline_leaves_nothing_behind(server: NotifyServer) -> None:
    server.waiters.register("never")
    with pytest.raises(KVReadyTimeout):
        await server.waiters.wait("never", timeout=0.05)
    assert (server.waiters.waiter_count(), server.waiters.early_count()) == (0, 0)


async def test_failed_transfer_wakes_with_error(server: NotifyServer,
                                                sender: NotifySender) -> None:
    server.waiters.register("r1")
    sender.send(server.endpoint, KVReady(request_id="r1", engine_id="p3", status="failed",
                                         error="WRITE aborted"))
    with pytest.raises(KVTransferFailed) as info:
        await server.waiters.wait("r1", timeout=10)
    assert (info.value.engine_id, info.value.error) == ("p3", "WRITE aborted")
    assert sample(server, MSGS, kind="kv_ready", result="failed") == 1


async def test_bad_frames_are_counted_and_loop_keeps_working(
    server: NotifyServer, raw_push: RawPush,
) -> None:
    push = raw_push(server.endpoint)
    push.send(b"\x00\xffnot msgpack")
    push.send(msgspec.msgpack.encode({"v": 99, "kind": "kv_ready", "request_id": "x"}))
    push.send(msgspec.msgpack.encode({"v": 1, "kind": "telepathy"}))
    push.send_multipart([b"a", b"b", b"c"])
    push.send(encode(ok("dup")))
    push.send(encode(ok("dup")))
    push.send(msgspec.msgpack.encode({"v": 1, "kind": "heartbeat", "engine_id": "p0"}))
    push.send(encode(ok("good")))
    assert (await server.waiters.wait("good", timeout=10)).request_id == "good"
    await eventually(lambda: server.frames_received == 8)
    assert sample(server, MSGS, kind="unknown", result="malformed") == 2
    assert sample(server, MSGS, kind="kv_ready", result="bad_version") == 1
    assert sample(server, MSGS, kind="unknown", result="unknown_kind") == 1
    assert sample(server, MSGS, kind="kv_ready", result="replay") == 1
    assert sample(server, MSGS, kind="heartbeat", result="ok") == 1


@pytest.mark.parametrize("secret", [None, SECRET])
async def test_nesting_bombs_and_a_10mb_frame_are_counted_and_the_loop_keeps_serving(
    make_server: ServerFactory, raw_push: RawPush, secret: str | None,
) -> None:
    # zmq's own cut (max_msg_bytes) raised so the 10 MB frame reaches our size check.
    server = await make_server(notify_secret=secret, max_msg_bytes=16 << 20)
    push = raw_push(server.endpoint)
    for payload in (msgpack_bomb(5_000), json_bomb(5_000)):  # fit max_frame_bytes: parsed
        push.send_multipart(signed(payload, secret))
    for payload in (msgpack_bomb(100_000), json_bomb(100_000), b"\x00" * (10 << 20)):
        push.send_multipart(signed(payload, secret))
    server.waiters.register("after")
    push.send_multipart(to_frames(ok("after"), None if secret is None else secret.encode()))
    assert (await server.waiters.wait("after", timeout=10)).request_id == "after"
    assert server.frames_received == 6
    assert sample(server, MSGS, kind="unknown", result="malformed") == 2
    assert sample(server, MSGS, kind="unknown", result="too_large") == 3


async def test_a_message_of_many_frames_is_refused(server: NotifyServer,
                                                   raw_push: RawPush) -> None:
    push = raw_push(server.endpoint)
    push.send_multipart([encode(ok("many"))] * 1000)
    push.send(encode(ok("after")))
    assert (await server.waiters.wait("after", timeout=10)).request_id == "after"
    assert server.frames_received == 2
    assert sample(server, MSGS, kind="unknown", result="malformed") == 1
    assert server.waiters.early_count() == 0


async def test_a_decoder_bug_is_counted_and_survived(
    server: NotifyServer, sender: NotifySender, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = server._decoder.decode
    calls = 0

    def flaky(frames: list[bytes]) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ZeroDivisionError("a bug")
        return real(frames)

    monkeypatch.setattr(server._decoder, "decode", flaky)
    sender.send(server.endpoint, ok("lost"))
    sender.send(server.endpoint, ok("after"))
    assert (await server.waiters.wait("after", timeout=10)).request_id == "after"
    assert sample(server, MSGS, kind="unknown", result="error") == 1


async def test_a_receive_bug_does_not_end_the_loop(
    server: NotifyServer, sender: NotifySender, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pdgate.proxy.server as mod

    real = mod._recv
    calls = 0

    def flaky(sock: zmq.Socket[bytes]) -> list[bytes] | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return real(sock)

    monkeypatch.setattr(mod, "_recv", flaky)
    sender.send(server.endpoint, ok("after"))
    assert (await server.waiters.wait("after", timeout=10)).request_id == "after"


async def test_forged_and_replayed_signed_notices_over_the_wire(
    make_server: ServerFactory, raw_push: RawPush,
) -> None:
    """What a prefill engine signs for an attacker (a failed notice for someone else's
    request, without its token) and a captured notice replayed: both dropped and counted."""
    server = await make_server(notify_secret=SECRET)
    key = SECRET.encode()
    server.waiters.register("victim", token=TOKEN)
    task = asyncio.create_task(server.waiters.wait("victim", timeout=10))
    push = raw_push(server.endpoint)
    push.send_multipart(to_frames(KVReady(request_id="victim", status="failed",
                                          token="attacker-chosen"), key))
    push.send_multipart(to_frames(KVReady(request_id="victim", status="failed"), key))
    await eventually(lambda: server.frames_received == 2)
    assert not task.done()
    real = to_frames(KVReady(request_id="victim", token=TOKEN), key)
    push.send_multipart(real)
    assert (await task).status == "ok"
    push.send_multipart(real)  # replayed after the wait
    push.send_multipart(to_frames(KVReady(request_id="ghost", token=TOKEN), key))
    await eventually(lambda: server.frames_received == 5)
    assert sample(server, REJECTED, reason="token_mismatch") == 2
    assert sample(server, REJECTED, reason="replay") == 1
    assert sample(server, REJECTED, reason="unknown_waiter") == 1
    assert sample(server, MSGS, kind="kv_ready", result="token_mismatch") == 2
    assert sample(server, MSGS, kind="kv_ready", result="ok") == 1
    assert server.waiters.early_count() == 0


def _junk(rids: list[str]) -> Iterator[list[bytes]]:
    """Every kind of junk a flooder can send, some of it validly signed (as a prefill engine
    would sign it for an attacker): garbage, wrong MACs, forged failed notices for the real
    requests, nesting bombs, oversized and many-frame messages."""
    key = SECRET.encode()
    i = 0
    while True:
        rid = rids[i % len(rids)]
        forged = encode(KVReady(request_id=rid, status="failed", token="guess"))
        yield from ([b"\x00\xffjunk"], [forged, b"\x00" * 32], [forged, sign(forged, key)],
                    signed(json_bomb(3_000), SECRET), [b"x" * (20 << 10)], [b"a", b"b", b"c"])
        i += 1


def _flood(endpoint: str, frames: Iterator[list[bytes]], n: int, stop: threading.Event) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 100)
    sock.connect(endpoint)
    try:
        sent = 0
        while sent < n and not stop.is_set():
            msg = next(frames)
            try:
                sock.send_multipart(msg)
            except zmq.Again:
                continue
            sent += 1
        stop.wait()  # linger 0: closing now would drop what is still queued
    finally:
        sock.close(linger=0)
        ctx.term()


async def test_real_notices_get_through_a_junk_flood(make_server: ServerFactory) -> None:
    """100k junk messages from one peer while another sends 200 real notices: all 200
    wake their waiters with status ok (fair queueing, cheap checks, no dying decoder)."""
    server = await make_server(notify_secret=SECRET)
    rids = [f"real-{i}" for i in range(200)]
    tokens = {rid: f"{i:032x}" for i, rid in enumerate(rids)}
    for rid in rids:
        server.waiters.register(rid, token=tokens[rid])
    waits = [asyncio.create_task(server.waiters.wait(rid, timeout=120)) for rid in rids]
    stop = threading.Event()
    flood = threading.Thread(target=_flood, args=(server.endpoint, _junk(rids), 100_000, stop))
    flood.start()
    try:
        await eventually(lambda: server.frames_received > 1_000, timeout=60)
        with NotifySender(secret=SECRET) as real:
            for rid in rids:
                assert real.send(server.endpoint, KVReady(request_id=rid, token=tokens[rid]))
                await asyncio.sleep(0.002)
            done = await asyncio.gather(*waits, return_exceptions=True)
        assert [getattr(m, "status", m) for m in done] == ["ok"] * 200
        await eventually(lambda: server.frames_received == 100_200, timeout=120)
    finally:
        stop.set()
        await asyncio.to_thread(flood.join)
    assert sample(server, MSGS, kind="kv_ready", result="ok") == 200
    assert sample(server, "pdgate_proxy_waits_total", outcome="failed") == 0
    assert server.waiters.early_count() == 0


async def test_oversized_frame_does_not_reach_the_table(
    make_server: ServerFactory, raw_push: RawPush, sender: NotifySender,
) -> None:
    server = await make_server(max_msg_bytes=1024)
    raw_push(server.endpoint).send(encode(KVReady(request_id="big", error="x" * 4096)))
    assert sender.send(server.endpoint, ok("after"))
    assert (await server.waiters.wait("after", timeout=10)).request_id == "after"
    assert server.frames_received == 1


async def test_hmac_forged_and_unsigned_frames_are_dropped(
    make_server: ServerFactory, raw_push: RawPush,
) -> None:
    server = await make_server(notify_secret=SECRET)
    push = raw_push(server.endpoint)
    push.send_multipart(to_frames(ok("r1")))  # unsigned
    push.send_multipart(to_frames(ok("r1"), b"wrong-secret-wrong-secret"))
    genuine = to_frames(ok("other"), SECRET.encode())
    push.send_multipart([encode(ok("r1")), genuine[1]])  # MAC of another payload
    await eventually(lambda: server.frames_received == 3)
    assert sample(server, MSGS, kind="unknown", result="bad_mac") == 3
    assert server.waiters.early_count() == 0
    with NotifySender(secret=SECRET) as signed:
        signed.send(server.endpoint, ok("r1"))
        assert (await server.waiters.wait("r1", timeout=10)).request_id == "r1"


async def test_lmcache_notification_wakes_waiter(server: NotifyServer, raw_push: RawPush) -> None:
    server.waiters.register("lm-7")
    raw_push(server.endpoint).send(msgspec.msgpack.encode({"type": "ProxyNotif",
                                                           "req_id": "lm-7"}))
    assert (await server.waiters.wait("lm-7", timeout=10)).request_id == "lm-7"
    assert sample(server, MSGS, kind="lmcache", result="ok") == 1


async def test_flood_of_unclaimed_notifications_is_bounded(
    make_server: ServerFactory, sender: NotifySender,
) -> None:
    server = await make_server(max_early=500)
    for i in range(5000):
        assert sender.send(server.endpoint, ok(f"flood-{i}"))
    await eventually(lambda: server.frames_received == 5000, timeout=30)
    assert server.waiters.early_count() == 500
    assert sample(server, "pdgate_proxy_evictions_total", reason="count") == 4500
    assert (await server.waiters.wait("flood-4999", timeout=1)).request_id == "flood-4999"


async def test_reaper_clears_expired_entries(make_server: ServerFactory,
                                             sender: NotifySender) -> None:
    server = await make_server(ttl_s=0.05, reap_interval_s=0.01)
    server.waiters.register("abandoned")
    for i in range(10):
        sender.send(server.endpoint, ok(f"orphan-{i}"))
    await eventually(lambda: server.frames_received == 10)
    await eventually(lambda: server.waiters.early_count() + server.waiters.waiter_count() == 0)
    assert sample(server, "pdgate_proxy_reaped_total", what="early") == 10
    assert sample(server, "pdgate_proxy_reaped_total", what="waiter") == 1
    assert server.waiters.early_bytes() == 0


async def test_ten_thousand_concurrent_waiters(server: NotifyServer,
                                               sender: NotifySender) -> None:
    rids = [f"c-{i}" for i in range(10_000)]
    for rid in rids:
        server.waiters.register(rid)
    tasks = [asyncio.create_task(server.waiters.wait(rid, timeout=60)) for rid in rids]
    await asyncio.sleep(0)
    for rid in reversed(rids):
        sender.send(server.endpoint, ok(rid))
    done = await asyncio.gather(*tasks)
    assert [m.request_id for m in done] == rids
    assert server.waiters.waiter_count() == 0
    assert sample(server, "pdgate_proxy_wake_latency_seconds_count") == 10_000


async def test_bursts_after_idle_gaps_all_wake(server: NotifyServer,
                                                 sender: NotifySender) -> None:
    """The loop sleeps on the socket's edge-triggered FD between bursts: every burst, of
    any size around the batch, must still be read in full (no lost edge, no hang)."""
    batch = server.config.batch
    for round_, size in enumerate((1, 2, batch - 1, batch, batch + 1, 3 * batch + 7, 1)):
        rids = [f"b{round_}-{i}" for i in range(size)]
        for rid in rids:
            server.waiters.register(rid)
        tasks = [asyncio.create_task(server.waiters.wait(rid, timeout=10)) for rid in rids]
        await asyncio.sleep(0.05)  # idle: the loop is parked on the FD
        for rid in rids:
            assert sender.send(server.endpoint, ok(rid))
        assert [m.request_id for m in await asyncio.gather(*tasks)] == rids


async def test_sender_in_another_process(make_server: ServerFactory) -> None:
    server = await make_server(notify_secret=SECRET)
    server.waiters.register("xp-1")
    code = textwrap.dedent(f"""
        from pdgate.proxy import KVReady, NotifySender
        with NotifySender(secret={SECRET!r}) as s:
            assert s.send({server.endpoint!r}, KVReady(request_id="xp-1", engine_id="p9"))
            import time; time.sleep(0.5)  # linger 0: give the frame time to leave
    """)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    msg = await server.waiters.wait("xp-1", timeout=30)
    assert await proc.wait() == 0
    assert msg.engine_id == "p9"


async def test_bind_conflict_fails_at_start(server: NotifyServer) -> None:
    clash = NotifyServer(ProxyConfig(bind=server.endpoint))
    with pytest.raises(zmq.ZMQError):
        await clash.start()
    await clash.close()


async def test_close_stops_tasks_and_socket(make_server: ServerFactory) -> None:
    server = await make_server()
    await server.close()
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert not names & {"proxy-recv", "proxy-reaper"}


async def test_advertised_endpoint_replaces_wildcard_host(make_server: ServerFactory) -> None:
    server = await make_server(advertise_host="10.1.2.3")
    port = server.endpoint.rsplit(":", 1)[1]
    assert server.advertised_endpoint == f"tcp://10.1.2.3:{port}"


def test_config_rejects_bad_values() -> None:
    for bad in ({"ttl_s": 0}, {"max_early": 0}, {"bind": "127.0.0.1:5"},
                {"notify_secret": "short"}, {"max_frame_bytes": 0}, {"batch_time_s": 0}):
        with pytest.raises(ValueError):
            ProxyConfig(**bad).validate()  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ProxyConfig(nonsense=1)  # type: ignore[call-arg]
