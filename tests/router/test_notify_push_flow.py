"""Notify and push flows against recording fake engines: what each engine is asked, in which
order, and what the client gets when a leg fails (router/flows/notify.py, push.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdgate.proxy import NotifySender
from pdgate.proxy.wire import KVReady
from tests.router.conftest import MODEL, RunningRouter, engine_rid, until
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
BODY = {"model": MODEL, "prompt": "Hello world", "max_tokens": 3}


async def _notify(make_engine: MakeEngine, start_router: StartRouter, **kw: Any
                  ) -> tuple[FakeEngine, FakeEngine, RunningRouter]:
    p = await make_engine(engine_id="P0", **kw)
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode="notify", kv_ready_timeout_s=10.0)
    return p, d, router


async def test_notify_reserves_on_d_then_prefills_then_decodes(
        make_engine: MakeEngine, start_router: StartRouter, tokenizer: Any) -> None:
    p, d, router = await _notify(make_engine, start_router)
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-n1"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "Hello world!"
    n = len(await tokenizer.encode_prompt("Hello world"))
    [prefill] = p.requests
    rid = prefill.headers["X-Request-Id"]  # the router's own id, not the client's
    assert rid != "rid-n1" and resp.headers["x-request-id"] == "rid-n1"
    assert d.reserves == [{"request_id": rid, "num_tokens": n}]
    kv = prefill.body["kv_transfer_params"]
    assert kv["do_remote_decode"] is True and kv["pdgate_mode"] == "notify"
    assert (kv["remote_engine_id"], kv["remote_port"]) == ("D0", 5700)
    assert kv["reservation_id"] == f"{rid}@1" and kv["notify_request_id"] == rid
    assert kv["notify_endpoint"].startswith("tcp://127.0.0.1:")
    assert kv["num_tokens"] == n and kv["write_deadline"] > time.time()
    assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
    [decode] = d.decodes
    dkv = decode.body["kv_transfer_params"]
    assert dkv["do_remote_prefill"] is True and dkv["reservation_id"] == f"{rid}@1"
    assert decode.body["max_tokens"] == 3
    assert decode.headers["X-Request-Id"] == rid
    assert resp.headers["x-pdgate-prefill-engine"] == p.url
    assert router.metric("pdgate_proxy_messages_total",
                         {"kind": "kv_ready", "result": "ok"}) == 1
    assert router.metric("pdgate_kv_wait_seconds_count", {"mode": "notify"}) == 1
    assert router.metric("pdgate_proxy_waiters") == 0
    assert p.aborts == [] and d.aborts == []


async def test_notify_streaming_relays_d(make_engine: MakeEngine,
                                         start_router: StartRouter) -> None:
    p, d, router = await _notify(make_engine, start_router)
    resp = await router.client.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200
    assert "Hello" in resp.text and resp.text.endswith("data: [DONE]\n\n")
    assert len(p.prefills) == 1 and d.decodes[0].body["stream"] is True


async def test_notify_failed_transfer_is_502_and_frees_both_sides(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _notify(make_engine, start_router, kv_ready="failed")
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-f"})
    assert resp.status_code == 502
    assert "fake write failure" in resp.json()["error"]["message"]
    assert d.decodes == []
    await until(lambda: p.aborts == [engine_rid(p)] and d.aborts == [engine_rid(p)])
    assert router.metric("pdgate_pd_flow_failures_total",
                         {"mode": "notify", "reason": "transfer_failed"}) == 1


async def test_notify_write_into_a_failed_decode_engine_retries_on_another_with_the_same_p(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    """P reports that its write into D0 failed (D0 died): D0 is to blame, not P, so the one
    prefill engine serves the retry with D1 and the client gets its answer."""
    p = await make_engine(engine_id="P0", kv_write_fails_to="D0")
    d0 = await make_engine(engine_id="D0")
    d1 = await make_engine(engine_id="D1")
    router = await start_router([p], [d0, d1], pd_mode="notify", decode_policy="round-robin")
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "Hello world!"
    assert resp.headers["x-pdgate-decode-engine"] == d1.url
    assert [len(p.prefills), len(d0.decodes), len(d1.decodes)] == [2, 0, 1]
    assert router.metric("pdgate_retries_total", {"role": "decode"}) == 1
    assert router.metric("pdgate_retries_total", {"role": "prefill"}) == 0
    await until(lambda: d0.aborts != [] and p.aborts != [])  # the failed attempt's state


async def test_notify_missing_kv_ready_is_504_at_the_deadline(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0", kv_ready="never")
    d = await make_engine(engine_id="D0")
    router = await start_router([p], [d], pd_mode="notify", kv_ready_timeout_s=0.5)
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-t"})
    assert resp.status_code == 504
    assert "no KV-ready notification" in resp.json()["error"]["message"]
    await until(lambda: p.aborts == [engine_rid(p)] and d.aborts == [engine_rid(p)])
    assert router.metric("pdgate_proxy_waiters") == 0


async def test_notify_prefill_error_ends_the_wait_at_once(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _notify(make_engine, start_router, fail_status=500)
    t0 = time.monotonic()
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-p"})
    assert resp.status_code == 502
    assert time.monotonic() - t0 < 5  # not the 10 s KV-ready deadline
    await until(lambda: d.aborts == [engine_rid(p)])
    assert d.decodes == []


async def test_notify_prefill_that_kept_no_kv_falls_back_to_recompute(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d, router = await _notify(make_engine, start_router, push_params=False)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    [decode] = d.decodes
    assert "kv_transfer_params" not in decode.body
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_kv_push"}) == 1


async def test_notify_runs_pull_when_d_cannot_reserve(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0")
    d = await make_engine(engine_id="D0", kv_endpoints=False)
    router = await start_router([p], [d], pd_mode="notify")
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    assert p.prefills[0].body["kv_transfer_params"].get("pdgate_mode") is None
    assert d.decodes[0].body["kv_transfer_params"]["remote_engine_id"] == "P0"
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_reserve"}) == 1


async def test_push_sends_both_legs_with_p_side_channel(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0")
    d = await make_engine(engine_id="D0", delay_s=0.3)
    router = await start_router([p], [d], pd_mode="push", kv_ready_timeout_s=10.0)
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-push"})
    assert resp.status_code == 200
    assert p.prefills[0].body["kv_transfer_params"]["pdgate_mode"] == "push"
    dkv = d.decodes[0].body["kv_transfer_params"]
    assert dkv["pdgate_mode"] == "push" and dkv["do_remote_prefill"] is True
    assert time.time() < dkv["push_deadline"] <= time.time() + 10.0  # kv_ready_timeout_s
    assert (dkv["remote_engine_id"], dkv["remote_host"], dkv["remote_port"]) == (
        "P0", "127.0.0.1", 5700)
    assert d.decodes[0].headers["X-Request-Id"] == p.prefills[0].headers["X-Request-Id"]
    assert d.decodes[0].headers["X-Request-Id"] != "rid-push"
    assert d.aborts == [] and p.aborts == []


async def test_push_prefill_failure_cancels_the_decode_leg(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0", fail_status=500)
    d = await make_engine(engine_id="D0", delay_s=10)
    router = await start_router([p], [d], pd_mode="push")
    t0 = time.monotonic()
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-pf"})
    assert resp.status_code == 502
    assert time.monotonic() - t0 < 5  # the D leg (10 s) was not waited for
    assert router.metric("pdgate_pd_flow_failures_total",
                         {"mode": "push", "reason": "prefill_failed"}) == 1


async def test_push_without_kv_from_p_tells_d_to_recompute(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    p = await make_engine(engine_id="P0", push_params=False)
    d = await make_engine(engine_id="D0", delay_s=0.5)
    router = await start_router([p], [d], pd_mode="push")
    resp = await router.client.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "rid-np"})
    assert resp.status_code == 200
    await until(lambda: d.aborts == [engine_rid(p)])
    assert router.metric("pdgate_fallbacks_total", {"reason": "no_kv_push"}) == 1


async def test_notify_forged_or_replayed_notices_cannot_fail_a_request(
        make_engine: MakeEngine, start_router: StartRouter) -> None:
    """Notices are bound to one waiter by the token the router gave P: a 'failed' notice for
    the same request id without that token (forged, or signed by P for another request) is
    dropped, and the request still completes with P's real notice."""
    p, d, router = await _notify(make_engine, start_router, kv_ready_delay_s=0.5)
    call = asyncio.ensure_future(router.client.post("/v1/completions", json=BODY))
    await until(lambda: len(p.prefills) == 1)
    kv = p.prefills[0].body["kv_transfer_params"]
    assert len(kv["notify_token"]) == 32  # fresh per waiter
    forged = [KVReady(request_id=kv["notify_request_id"], status="failed", error="forged"),
              KVReady(request_id=kv["notify_request_id"], status="failed", error="forged",
                      token="0" * 32)]
    with NotifySender() as sender:
        for notice in forged:
            sender.send(kv["notify_endpoint"], notice)
        resp = await call
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "Hello world!"
    assert router.metric("pdgate_proxy_notifications_rejected_total",
                         {"reason": "token_mismatch"}) == 2
