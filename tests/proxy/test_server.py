"""NotifyServer over real zmq sockets on loopback: wake-ups, bad frames, caps, reaper."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Callable

import msgspec
import pytest
import zmq

from proxy import (
    KVReady,
    KVReadyTimeout,
    KVTransferFailed,
    NotifySender,
    NotifyServer,
    ProxyConfig,
)
from proxy.wire import encode, to_frames
from tests.proxy.conftest import SECRET, ServerFactory, eventually, sample

MSGS = "pdgate_proxy_messages_total"
RawPush = Callable[[str], zmq.Socket[bytes]]


def ok(rid: str) -> KVReady:
    return KVReady(request_id=rid, engine_id="p0", num_tokens=16, num_blocks=1)


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
        from proxy import KVReady, NotifySender
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
                {"notify_secret": "short"}):
        with pytest.raises(ValueError):
            ProxyConfig(**bad).validate()  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ProxyConfig(nonsense=1)  # type: ignore[call-arg]
