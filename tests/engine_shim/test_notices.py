"""NIXL notifications (engine_shim/notices.py): one typed, versioned frame per kind.

Every kind round-trips whatever its ids hold (a `pdgate:` prefix, separators, newlines,
non-ASCII, thousands of characters) and decodes as itself, never as another kind; anything
else (old text formats, junk, nesting bombs, oversized frames, other versions) is a
`NoticeError` with a metric reason. A connector counts such frames and still handles the
valid notices around them.
"""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.notices import (
    MAX_NOTICE_BYTES,
    NOTICE_VERSION,
    Failed,
    Landed,
    Notice,
    NoticeError,
    ReadDone,
    Registration,
    Unregistration,
    decode_notice,
    encode_notice,
    failed,
)
from tests.engine_shim.fake_nixl import FakeFabric, started_connector, until

HOSTILE_IDS = ["pdgate:reg:x", "pdgate:landed:req-1", "pdgate:unreg:", "a:b:1", "line\nbreak",
               "prüfung-日本-🚀", "x" * 5000, ""]


@pytest.mark.parametrize("rid", HOSTILE_IDS, ids=range(len(HOSTILE_IDS)))
def test_every_kind_round_trips_and_stays_its_kind(rid: str) -> None:
    notices: list[Notice] = [
        ReadDone(lease_id=rid), Unregistration(request_id=rid),
        Landed(tag=rid, first_token_ids=[17, 4]), Landed(tag=rid),
        Failed(tag=rid, reason="transfer", detail="x" * 512), Failed(tag=rid, reason="aborted"),
        Registration(request_id=rid, engine_id="d", host="127.0.0.1", port=5600,
                     agent_name="d-1", block_ids=[3, 1, 2], num_tokens=10),
    ]
    for notice in notices:
        assert decode_notice(encode_notice(notice)) == notice


def _frame(v: int, notice: object) -> bytes:
    return msgspec.msgpack.encode({"v": v, "notice": notice})


BAD_FRAMES = {
    "old-registration-text": (b"pdgate:reg:" + msgspec.msgpack.encode(["r"]), "malformed"),
    "old-landed-text": (b"pdgate:landed:req-1\n17", "malformed"),
    "vllm-done-text": (b"req-1:1", "malformed"),
    "empty": (b"", "malformed"),
    "nesting-bomb": (b"\x91" * 200_000 + b"\x01", "malformed"),
    "bomb-in-skipped-field": (b"\x82\xa1v\x01\xa1x" + b"\x91" * 200_000 + b"\x01",
                              "malformed"),
    "bomb-in-notice": (b"\x82\xa1v\x01\xa6notice" + b"\x91" * 200_000 + b"\x01", "malformed"),
    "unknown-kind": (_frame(NOTICE_VERSION, {"kind": "evict", "request_id": "r"}),
                     "malformed"),
    "unknown-field": (_frame(NOTICE_VERSION, {"kind": "done", "lease_id": "r", "x": 1}),
                      "malformed"),
    "negative-block": (_frame(NOTICE_VERSION, {
        "kind": "reg", "request_id": "r", "engine_id": "d", "host": "h", "port": 1,
        "agent_name": "a", "block_ids": [-1], "num_tokens": 1}), "malformed"),
    "bad-port": (_frame(NOTICE_VERSION, {
        "kind": "reg", "request_id": "r", "engine_id": "d", "host": "h", "port": 70000,
        "agent_name": "a", "block_ids": [1], "num_tokens": 1}), "malformed"),
    "newer-version": (_frame(NOTICE_VERSION + 1, {"kind": "done", "lease_id": "r"}),
                      "bad_version"),
    "v1-frame": (_frame(1, {"kind": "done", "lease_id": "r"}), "bad_version"),
    "failed-without-reason": (_frame(NOTICE_VERSION, {"kind": "failed", "tag": "r"}),
                              "malformed"),
    "failed-reason-too-long": (_frame(NOTICE_VERSION, {
        "kind": "failed", "tag": "r", "reason": "x" * 33}), "malformed"),
    "failed-detail-too-long": (_frame(NOTICE_VERSION, {
        "kind": "failed", "tag": "r", "reason": "transfer", "detail": "x" * 513}),
        "malformed"),
    "oversized": (b"\x00" * (MAX_NOTICE_BYTES + 1), "oversized"),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_anything_else_is_a_notice_error_with_a_reason(name: str) -> None:
    frame, reason = BAD_FRAMES[name]
    with pytest.raises(NoticeError) as info:
        decode_notice(frame)
    assert info.value.reason == reason


def test_a_notice_no_peer_would_accept_is_refused_when_encoding() -> None:
    with pytest.raises(NoticeError, match="oversized"):
        encode_notice(ReadDone(lease_id="x" * MAX_NOTICE_BYTES))


def test_failed_cuts_its_reason_and_detail_to_what_peers_accept() -> None:
    notice = failed("r", "a-reason-word-far-longer-than-a-label", "why " * 1000)
    assert decode_notice(encode_notice(notice)) == notice
    assert len(notice.reason) == 32 and len(notice.detail) == 512


def _errors(metrics: ShimMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "pdgate_shim_protocol_errors_total", {"channel": "nixl_notice", "reason": reason})
    return value or 0.0


async def test_connector_counts_bad_notices_and_still_frees_leases_named_like_notices() -> None:
    """The batch P's agent thread gets: junk first, then D's "done" for a lease whose id
    looks like a push notice. The junk is counted; the lease is freed (the old text format
    read `pdgate:...` ids as push notices and left the blocks pinned until the lease
    expired). P runs on a fake NIXL agent (fake_nixl.py); the frames come through it."""
    freed: list[int] = []
    metrics = ShimMetrics.create(CollectorRegistry())
    fabric = FakeFabric()
    conn = started_connector(fabric, "p", metrics=metrics, free_blocks=freed.extend)
    try:
        params = conn.hold_for_remote_decode("pdgate:reg:evil", [1, 2, 3])
        assert conn.leased_blocks() == 3
        for junk, _ in BAD_FRAMES.values():
            fabric.send("d-agent", conn.agent_name, junk)
        fabric.send("d-agent", conn.agent_name,
                    encode_notice(ReadDone(lease_id=str(params["remote_request_id"]))))
        await until(lambda: conn.leased_blocks() == 0)
        assert freed == [1, 2, 3]
        expected = [reason for _, reason in BAD_FRAMES.values()]
        for reason in ("malformed", "bad_version", "oversized"):
            assert _errors(metrics, reason) == expected.count(reason)
    finally:
        conn.close()
