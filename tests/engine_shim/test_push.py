"""`PendingPushes` (engine_shim/push.py): P's table of finished prompts and D's registrations.

Every registration gets exactly one answer: a `Match` (P writes), a `Refusal` (P tells that D
at once with a `failed` notice) or None (kept until the prompt comes; expiry, abort and
shutdown turn it into a Refusal later). Both orderings of "P finished" and "D registered"
match; either side expires after the TTL; request ids P will not write for are remembered
("closed") so a late registration is refused at once; the first registration for a request
id stands: a resend from its agent is ignored, one from another agent is refused, and only
the registering agent can unregister it.

The connector side (connectors on fake NIXL agents, `fake_nixl.py`, with real side
channels): P tells the registered D when the router aborts or the prefill fails, a
registration after an abort or from a second agent is answered at once, one naming another
agent is dropped, and a D waiting for a landing stops at P's `failed` notice (a stray one,
for a landing nobody awaits, is dropped). Over real NIXL:
tests/engine_shim/test_push_failures.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from pdgate.contract.kv_contract import PushDecodeParams, PushPrefillParams
from pdgate.engine_shim.connector import KVConnector
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.notices import (
    FAILURE_REASONS,
    NOTICE_VERSION,
    Failed,
    Landed,
    Registration,
    Unregistration,
    decode_notice,
    encode_notice,
    failed,
)
from pdgate.engine_shim.push import Expired, Match, PendingPushes, Refusal
from pdgate.engine_shim.transfer_errors import KVTransferError
from tests.engine_shim.fake_nixl import FakeFabric, started_connector, until

TTL = 10.0
PARAMS = PushPrefillParams(num_tokens=6, notify_endpoint="tcp://127.0.0.1:1",
                           notify_request_id="n-1", notify_token="tok")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _reg(rid: str = "r", agent: str = "d-1", blocks: tuple[int, ...] = (7, 8)) -> Registration:
    return Registration(request_id=rid, engine_id="d-" + agent, host="127.0.0.1", port=5600,
                        agent_name=agent, block_ids=list(blocks), num_tokens=6)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> PendingPushes:
    return PendingPushes(TTL, max_entries=4, clock=clock)


def _match(answer: Match | Refusal | None) -> Match:
    assert isinstance(answer, Match), answer
    return answer


def _refusal(answer: Match | Refusal | None, reason: str) -> Refusal:
    assert isinstance(answer, Refusal), answer
    assert answer.reason == reason and reason in FAILURE_REASONS
    assert answer.target.tag == answer.request_id  # D's landing is keyed by request id
    return answer


def test_prompt_first_then_registration_matches(table: PendingPushes) -> None:
    assert table.offer("r", [1, 2], 6, PARAMS, (42,)) is None
    assert table.blocks == 2 and len(table) == 1
    m = _match(table.register(_reg()))
    assert (m.request_id, m.block_ids, m.num_tokens, m.first_token_ids) == ("r", (1, 2), 6,
                                                                             (42,))
    assert m.target.block_ids == (7, 8) and m.target.agent_name == "d-1"
    assert m.target.notify_token == "tok"  # P's own params name the router's proxy
    assert table.blocks == 0 and len(table) == 0


def test_registration_first_then_prompt_matches(table: PendingPushes) -> None:
    assert table.register(_reg()) is None
    assert len(table) == 1 and table.blocks == 0
    m = _match(table.offer("r", [1, 2], 6, PARAMS, (42,)))
    assert m.block_ids == (1, 2) and m.target.block_ids == (7, 8)
    assert m.first_token_ids == (42,) and m.target.notify_request_id == "n-1"
    assert len(table) == 0


def test_prompt_expires_its_blocks_are_returned_and_a_late_registration_refused(
        table: PendingPushes, clock: Clock) -> None:
    table.offer("r", [1, 2], 6, None)
    clock.now += TTL - 0.1
    assert table.expire() == Expired([], [])
    clock.now += 0.1
    assert table.expire() == Expired([("r", (1, 2))], [])
    assert table.blocks == 0
    _refusal(table.register(_reg()), "expired")  # at once, not after D's timeout


def test_shed_gives_up_the_oldest_prompts_old_enough_until_the_need_is_met(
        table: PendingPushes, clock: Clock) -> None:
    """An admission starved by prompts nobody registered for (both pools full in push
    mode): the oldest go first, only those held `min_age_s`, and no more than needed; a
    registration for one of them is refused at once, so its D computes the prompt."""
    table.offer("a", [1, 2], 6, None)
    clock.now += 0.3
    table.offer("b", [3, 4], 6, None)
    table.offer("c", [5, 6], 6, None)
    assert table.shed(4, min_age_s=0.5) == []  # none held 0.5 s yet
    clock.now += 0.2
    assert table.shed(4, min_age_s=0.5) == []  # no D holds blocks for a prompt of ours
    table.register(_reg("q", "d-2"))  # now a D waits for a prompt not computed yet
    assert table.shed(3, min_age_s=0.5) == [("a", (1, 2))]  # b and c are 0.2 s old
    clock.now += 0.3
    assert table.shed(3, min_age_s=0.5) == [("b", (3, 4)), ("c", (5, 6))]
    assert table.blocks == 0 and len(table) == 1  # q's registration stays
    _refusal(table.register(_reg("a")), "expired")
    _refusal(table.register(_reg("c")), "expired")
    assert table.shed(1, min_age_s=0.0) == []  # nothing left to give up


def test_registration_expires_into_a_refusal(table: PendingPushes, clock: Clock) -> None:
    table.register(_reg("a", "d-1"))
    clock.now += 1
    table.register(_reg("b", "d-2"))
    clock.now += TTL - 1
    out = table.expire()
    assert out.blocks == [] and [r.request_id for r in out.refusals] == ["a"]
    assert _refusal(out.refusals[0], "expired").target.agent_name == "d-1"
    clock.now += 1
    assert [r.request_id for r in table.expire().refusals] == ["b"]
    assert len(table) == 0
    assert table.offer("a", [1], 6, None) is None  # nobody is registered any more


def test_closed_ids_are_forgotten_after_the_ttl(table: PendingPushes, clock: Clock) -> None:
    table.abort("r")
    _refusal(table.register(_reg()), "aborted")
    clock.now += TTL
    table.expire()
    assert table.register(_reg()) is None  # kept again: the abort is long past


def test_unregister_drops_only_the_registering_agents_entry(table: PendingPushes) -> None:
    table.register(_reg("r", "d-1"))
    table.unregister("r", "someone-else")  # another peer cannot cancel D's registration
    assert len(table) == 1
    table.unregister("r", "d-1")
    assert len(table) == 0
    assert table.offer("r", [1], 6, None) is None  # held: D's registration is gone
    table.unregister("nobody", "d-1")  # unknown ids are a no-op


def test_a_second_registration_from_another_agent_is_refused_and_the_first_stands(
        table: PendingPushes) -> None:
    assert table.register(_reg("r", "d-1", (7, 8))) is None
    dup = _refusal(table.register(_reg("r", "d-2", (5, 6))), "duplicate")
    assert dup.target.agent_name == "d-2"  # only the newcomer is told
    m = _match(table.offer("r", [1, 2], 6, None))
    assert m.target.agent_name == "d-1" and m.target.block_ids == (7, 8)


def test_a_resend_from_the_same_agent_is_ignored(table: PendingPushes) -> None:
    """Answering it would fail the first registration's wait: D keys landings by id."""
    table.register(_reg("r", "d-1", (7, 8)))
    assert table.register(_reg("r", "d-1", (9, 9))) is None
    assert _match(table.offer("r", [1, 2], 6, None)).target.block_ids == (7, 8)


def test_registrations_after_a_match_are_refused_or_ignored(table: PendingPushes) -> None:
    table.offer("r", [1, 2], 6, None)
    _match(table.register(_reg("r", "d-1")))
    assert table.register(_reg("r", "d-1")) is None  # the served agent: a resend
    _refusal(table.register(_reg("r", "d-2")), "duplicate")
    assert len(table) == 0  # neither is kept waiting for a prompt that will not come


def test_abort_returns_the_blocks_and_the_waiting_registration(table: PendingPushes) -> None:
    table.offer("p", [1, 2, 3], 6, None)
    assert table.abort("p") == ((1, 2, 3), None)
    table.register(_reg("r"))
    blocks, refusal = table.abort("r", "prefill", "prefill error")
    assert blocks == ()
    assert _refusal(refusal, "prefill").detail == "prefill error"
    assert len(table) == 0 and table.blocks == 0


def test_a_registration_after_an_abort_is_refused_at_once(table: PendingPushes) -> None:
    table.abort("r")  # the router aborted P before D's registration arrived
    _refusal(table.register(_reg()), "aborted")
    _refusal(table.register(_reg(agent="d-2")), "aborted")
    assert len(table) == 0


def test_a_fresh_prefill_reopens_a_closed_id(table: PendingPushes) -> None:
    table.abort("r", "prefill")  # e.g. its first prefill failed
    assert table.offer("r", [1], 6, None) is None
    _match(table.register(_reg()))


def test_a_prefill_the_routers_abort_overtook_is_not_held(table: PendingPushes) -> None:
    table.abort("r")  # the router gave up while P was still prefilling
    with pytest.raises(KVTransferError, match="aborted"):
        table.offer("r", [1], 6, None)
    assert len(table) == 0 and table.blocks == 0
    assert isinstance(table.register(_reg()), Refusal)  # and stays closed


def test_abort_keeps_who_was_served(table: PendingPushes) -> None:
    table.offer("r", [1], 6, None)
    _match(table.register(_reg("r", "d-1")))
    table.abort("r")  # the write is in flight: its D must not be told otherwise
    assert table.register(_reg("r", "d-1")) is None


def test_full_tables_refuse_new_entries_without_dropping_old_ones(
        table: PendingPushes) -> None:
    for i in range(4):
        assert table.register(_reg(f"r{i}", "d-1")) is None
    _refusal(table.register(_reg("r4", "d-1")), "full")
    _match(table.offer("r0", [1], 6, None))  # the oldest was kept
    for i in range(4):
        table.offer(f"p{i}", [i], 6, None)
    with pytest.raises(KVTransferError, match="too many"):
        table.offer("p4", [9], 6, None)
    with pytest.raises(KVTransferError):
        table.offer("p0", [9], 6, None)  # the same prompt offered twice


def test_closed_ids_are_bounded(table: PendingPushes) -> None:
    for i in range(10):
        table.abort(f"r{i}")
    assert table.register(_reg("r0")) is None  # forgotten (oldest first)
    _refusal(table.register(_reg("r9")), "aborted")


def test_pop_all_returns_every_block_and_refuses_every_registration(
        table: PendingPushes) -> None:
    table.offer("p", [1, 2], 6, None)
    table.register(_reg("a", "d-1"))
    table.register(_reg("b", "d-2"))
    blocks, refusals = table.pop_all()
    assert blocks == (1, 2)
    assert sorted(_refusal(r, "shutdown").request_id for r in refusals) == ["a", "b"]
    assert len(table) == 0 and table.blocks == 0


# -- the connector: who gets a `failed` notice, and what D does with one ----------------------
# Connectors on fake NIXL agents (fake_nixl.py) with real side channels: notices travel
# through the fake fabric, P meets D by a real handshake before telling it.

Trio = tuple[FakeFabric, KVConnector, KVConnector, KVConnector]
METRICS: dict[str, ShimMetrics] = {}  # by engine id, for the trio being tested


@pytest.fixture
async def trio() -> AsyncIterator[Trio]:
    """P and two decode engines on one fabric."""
    fabric = FakeFabric()
    METRICS.clear()
    conns = []
    for name in ("p", "d1", "d2"):
        METRICS[name] = ShimMetrics.create(CollectorRegistry())
        conns.append(started_connector(fabric, name, metrics=METRICS[name]))
    yield fabric, conns[0], conns[1], conns[2]
    for c in conns:
        c.close()


def _register(fabric: FakeFabric, p: KVConnector, d: KVConnector, rid: str = "r",
              sender: str | None = None) -> None:
    """D's registration for `rid` as D's agent sends it (or as `sender` does)."""
    reg = Registration(request_id=rid, engine_id=d.engine_id, host="127.0.0.1",
                       port=d.side_channel_port, agent_name=d.agent_name, block_ids=[7, 8],
                       num_tokens=6)
    fabric.send(sender or d.agent_name, p.agent_name, encode_notice(reg))


def _told(fabric: FakeFabric, p: KVConnector, *ds: KVConnector) -> list[tuple[str, str, str]]:
    """(tag, reason, engine told) of every failed notice P sent to one of `ds`."""
    names = {d.agent_name: d.engine_id for d in ds}
    return [(n.tag, n.reason, names[to]) for sender, to, frame in fabric.sent
            if sender == p.agent_name and to in names
            for n in [decode_notice(frame)] if isinstance(n, Failed)]


async def _quiet() -> None:
    await asyncio.sleep(0.2)  # long enough for an unexpected extra notice to show


async def test_p_tells_the_registered_d_when_the_router_aborts(trio: Trio) -> None:
    fabric, p, d1, d2 = trio
    _register(fabric, p, d1)
    await until(lambda: p.pending_pushes() == 1)
    p.abort("r")
    await until(lambda: len(_told(fabric, p, d1, d2)) == 1)
    await _quiet()
    assert _told(fabric, p, d1, d2) == [("r", "aborted", "d1")]
    assert p.pending_pushes() == 0


async def test_a_registration_after_the_abort_is_answered_at_once(trio: Trio) -> None:
    fabric, p, d1, d2 = trio
    p.abort("r")
    _register(fabric, p, d1)
    await until(lambda: len(_told(fabric, p, d1, d2)) == 1)
    assert _told(fabric, p, d1, d2) == [("r", "aborted", "d1")]


async def test_a_failed_prefill_tells_the_registered_d(trio: Trio) -> None:
    fabric, p, d1, d2 = trio
    _register(fabric, p, d1)
    await until(lambda: p.pending_pushes() == 1)
    p.fail_push("r", "prefill", "prefill error")
    p.fail_push("r", "prefill", "released too")  # idempotent: told once
    await until(lambda: len(_told(fabric, p, d1, d2)) == 1)
    await _quiet()
    assert _told(fabric, p, d1, d2) == [("r", "prefill", "d1")]


async def test_only_the_second_registrant_is_told_of_a_duplicate(trio: Trio) -> None:
    fabric, p, d1, d2 = trio
    _register(fabric, p, d1)
    await until(lambda: p.pending_pushes() == 1)
    _register(fabric, p, d2)
    _register(fabric, p, d1)  # resend: quiet
    fabric.send(d2.agent_name, p.agent_name,
                encode_notice(Unregistration(request_id="r")))  # not d2's to drop
    await until(lambda: len(_told(fabric, p, d1, d2)) == 1)
    await _quiet()
    assert _told(fabric, p, d1, d2) == [("r", "duplicate", "d2")]
    assert p.pending_pushes() == 1
    fabric.send(d1.agent_name, p.agent_name, encode_notice(Unregistration(request_id="r")))
    await until(lambda: p.pending_pushes() == 0)


async def test_a_registration_naming_another_agent_is_dropped(trio: Trio) -> None:
    fabric, p, d1, d2 = trio
    _register(fabric, p, d1, sender=d2.agent_name)  # d2 points P's WRITE at d1
    await until(lambda: _errors(p, "bad_sender") == 1)
    assert p.pending_pushes() == 0
    _register(fabric, p, d1)
    await until(lambda: p.pending_pushes() == 1)


async def test_a_malformed_registration_is_counted_and_never_kept(trio: Trio) -> None:
    fabric, p, d1, d2 = trio
    bad = msgspec.msgpack.encode({"v": NOTICE_VERSION, "notice": {
        "kind": "reg", "request_id": "r", "engine_id": "d", "host": "h", "port": 1,
        "agent_name": d1.agent_name, "block_ids": ["1"], "num_tokens": 1}})
    fabric.send(d1.agent_name, p.agent_name, bad)
    _register(fabric, p, d1)  # the valid one is kept
    await until(lambda: p.pending_pushes() == 1)
    await _quiet()
    assert _told(fabric, p, d1, d2) == []
    assert _errors(p, "malformed") == 1


async def test_d_stops_waiting_when_p_says_the_write_will_not_land(trio: Trio) -> None:
    """D registers with P over a real handshake; P then gives up on the request: D's wait
    ends at once with the reason "peer", not at its 30 s transfer timeout."""
    _, p, d1, _ = trio
    params = PushDecodeParams(remote_engine_id=p.engine_id, remote_host="127.0.0.1",
                              remote_port=p.side_channel_port, remote_agent_name=p.agent_name)
    wait = asyncio.create_task(d1.await_push(params, "r", [1, 2], 6))
    await until(lambda: p.pending_pushes() == 1)
    t0 = time.monotonic()
    p.fail_push("r", "transfer", "WRITE failed")
    with pytest.raises(KVTransferError, match="transfer: WRITE failed") as info:
        await wait
    # at once: well inside the 30 s transfer timeout it would otherwise wait (the margin
    # is for a loaded CI machine, not the measure)
    assert info.value.reason == "peer" and time.monotonic() - t0 < 5.0


async def test_await_landing_reads_a_failed_notice_as_not_landed(trio: Trio) -> None:
    fabric, _, d1, _ = trio
    d1.expect_landing("res-1")  # notify: D reserved; P's failure may come before the leg
    fabric.send("p-1", d1.agent_name, encode_notice(failed("res-1", "timeout")))
    t0 = time.monotonic()
    assert await d1.await_landing("res-1", 30.0) is None
    assert time.monotonic() - t0 < 5.0  # the notice ends it, not the 30 s wait


async def test_a_stray_failed_notice_cannot_poison_a_later_wait(trio: Trio) -> None:
    fabric, _, d1, _ = trio
    fabric.send("p-1", d1.agent_name, encode_notice(failed("r", "aborted")))
    await _quiet()  # processed (and dropped) by now
    wait = asyncio.create_task(d1.await_landing("r", 30.0))
    await asyncio.sleep(0.01)
    fabric.send("p-1", d1.agent_name, encode_notice(Landed(tag="r", first_token_ids=[5])))
    assert await wait == (5,)


async def test_a_push_deadline_in_the_past_fails_before_registering(trio: Trio) -> None:
    _, _, d1, _ = trio
    params = PushDecodeParams(remote_engine_id="p", remote_host="127.0.0.1", remote_port=9,
                              push_deadline=time.time() - 1)
    with pytest.raises(KVTransferError, match="push_deadline passed") as info:
        await d1.await_push(params, "r", [1], 4)
    assert info.value.reason == "timeout"


def _errors(conn: KVConnector, reason: str) -> float:
    return METRICS[conn.engine_id].registry.get_sample_value(
        "pdgate_shim_protocol_errors_total",
        {"channel": "nixl_notice", "reason": reason}) or 0.0
