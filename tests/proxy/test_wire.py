"""The wire contract: round trips, two-phase decode errors, HMAC, LMCache compatibility."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from pdgate import proxy
from pdgate.proxy.wire import (
    MAC_SIZE,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    FrameDecoder,
    Heartbeat,
    KVReady,
    WireError,
    encode,
    sign,
    to_frames,
)

PKG = Path(proxy.__file__).parent
KEY = b"k" * 32


def _reason(decoder: FrameDecoder, frames: list[bytes]) -> tuple[str, str]:
    with pytest.raises(WireError) as info:
        decoder.decode(frames)
    return info.value.reason, info.value.kind


def test_round_trip_each_kind() -> None:
    ready = KVReady(request_id="r1", engine_id="p0", num_tokens=17, num_blocks=2,
                    status="failed", error="nixl: peer gone")
    beat = Heartbeat(engine_id="p0")
    dec = FrameDecoder()
    assert dec.decode([encode(ready)]) == ("kv_ready", ready)
    assert dec.decode([encode(beat)]) == ("heartbeat", beat)
    assert dec.decode([msgspec.json.encode(ready)]) == ("kv_ready", ready)
    assert ready.v == PROTOCOL_VERSION


def test_unknown_version_and_kind_are_named() -> None:
    dec = FrameDecoder()
    future = msgspec.msgpack.encode({"v": PROTOCOL_VERSION + 1, "kind": "kv_ready",
                                     "request_id": "r", "new_field": [1, 2]})
    assert _reason(dec, [future]) == ("bad_version", "kv_ready")
    other = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "kind": "subscribe"})
    assert _reason(dec, [other]) == ("unknown_kind", "unknown")


@pytest.mark.parametrize("payload", [
    b"", b"\xc1garbage", b"{not json", msgspec.msgpack.encode([1, 2, 3]),
    msgspec.msgpack.encode({"v": "1", "kind": "kv_ready", "request_id": "r"}),
    msgspec.msgpack.encode({"v": 1, "kind": "kv_ready", "request_id": ""}),
    msgspec.msgpack.encode({"v": 1, "kind": "kv_ready", "request_id": "r", "status": "meh"}),
    msgspec.msgpack.encode({"v": 1, "kind": "kv_ready", "request_id": "r", "num_tokens": -1}),
    msgspec.msgpack.encode({"hello": "world"}),
])
def test_malformed_payloads_raise_wire_error(payload: bytes) -> None:
    assert _reason(FrameDecoder(), [payload])[0] == "malformed"


def test_frame_count_is_checked() -> None:
    frame = encode(KVReady(request_id="r"))
    assert _reason(FrameDecoder(), [])[0] == "malformed"
    assert _reason(FrameDecoder(), [frame, b"a", b"b"])[0] == "malformed"


def test_hmac_required_when_secret_set() -> None:
    msg = KVReady(request_id="r")
    dec = FrameDecoder(KEY)
    assert dec.decode(to_frames(msg, KEY)) == ("kv_ready", msg)
    assert _reason(dec, to_frames(msg))[0] == "bad_mac"
    assert _reason(dec, to_frames(msg, b"x" * 32))[0] == "bad_mac"
    payload = encode(msg)
    forged = encode(KVReady(request_id="other"))
    assert _reason(dec, [forged, sign(payload, KEY)])[0] == "bad_mac"
    assert _reason(dec, [payload, b""])[0] == "bad_mac"


def test_without_secret_a_mac_frame_is_ignored() -> None:
    msg = KVReady(request_id="r")
    assert FrameDecoder().decode(to_frames(msg, KEY)) == ("kv_ready", msg)


@pytest.mark.parametrize("payload", [
    msgspec.msgpack.encode({"type": "ProxyNotif", "req_id": "lm-1"}),  # LMCache tagged struct
    msgspec.msgpack.encode({"req_id": "lm-1", "status": "completed"}),  # untagged NixlMsg
    b'{"req_id": "lm-1"}',
])
def test_lmcache_notification_decodes_as_ready(payload: bytes) -> None:
    kind, msg = FrameDecoder().decode([payload])
    assert kind == "lmcache"
    assert isinstance(msg, KVReady)
    assert (msg.request_id, msg.status) == ("lm-1", "ok")


def test_v2_carries_the_token_and_v1_still_decodes() -> None:
    assert (PROTOCOL_VERSION, SUPPORTED_VERSIONS) == (2, frozenset({1, 2}))
    ready = KVReady(request_id="r1", token="a" * 32)
    dec = FrameDecoder(KEY)
    assert dec.decode(to_frames(ready, KEY)) == ("kv_ready", ready)
    v1 = msgspec.msgpack.encode({"v": 1, "kind": "kv_ready", "request_id": "r1",
                                 "engine_id": "p0", "status": "failed", "ts": 1.0})
    kind, msg = dec.decode([v1, sign(v1, KEY)])
    assert isinstance(msg, KVReady)
    assert (kind, msg.v, msg.token, msg.status) == ("kv_ready", 1, "", "failed")


def test_token_length_is_bounded() -> None:
    long = msgspec.msgpack.encode({"v": 2, "kind": "kv_ready", "request_id": "r",
                                   "token": "t" * 129})
    assert _reason(FrameDecoder(), [long]) == ("malformed", "kv_ready")
    assert FrameDecoder().decode([encode(KVReady(request_id="r", token="t" * 128))])


def _nested_msgpack(depth: int, at_key: bool) -> bytes:
    bomb = b"\x91" * depth + b"\x01"  # [[[...[1]...]]]
    if not at_key:
        return bomb
    # a kv_ready map whose extra field (skipped by the envelope) holds the bomb
    head = msgspec.msgpack.encode({"v": 2, "kind": "kv_ready", "request_id": "r"})
    return bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode("x") + bomb


def _nested_json(depth: int, at_key: bool) -> bytes:
    bomb = b"[" * depth + b"]" * depth
    return b'{"v": 2, "kind": "kv_ready", "x": ' + bomb + b"}" if at_key else bomb


@pytest.mark.parametrize("make", [_nested_msgpack, _nested_json])
@pytest.mark.parametrize("at_key", [True, False])
@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_nesting_bombs_are_malformed_not_recursion_errors(
    make: object, at_key: bool, depth: int,
) -> None:
    payload = make(depth, at_key)  # type: ignore[operator]
    for dec in (FrameDecoder(max_frame_bytes=1 << 20), FrameDecoder(KEY, max_frame_bytes=1 << 20)):
        frames = [payload, sign(payload, KEY)]
        assert _reason(dec, frames)[0] == "malformed"
    # With the default size limit a 100k-deep bomb is refused before it is parsed.
    want = "too_large" if len(payload) > MAX_FRAME_BYTES else "malformed"
    assert _reason(FrameDecoder(), [payload])[0] == want


def test_size_is_checked_before_the_mac() -> None:
    dec = FrameDecoder(KEY, max_frame_bytes=1024)
    big = encode(KVReady(request_id="r", error="x" * 2000))
    assert _reason(dec, [big, sign(big, KEY)])[0] == "too_large"  # even with a valid MAC
    assert _reason(FrameDecoder(max_frame_bytes=1024), [big])[0] == "too_large"
    small = encode(KVReady(request_id="r"))
    assert _reason(dec, [small, sign(small, KEY)[:-1]])[0] == "bad_mac"
    assert _reason(dec, [small, sign(small, KEY) + b"x"])[0] == "bad_mac"
    assert len(sign(small, KEY)) == MAC_SIZE


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_wire_module_is_pure_data() -> None:
    assert _imports(PKG / "wire.py") <= {"__future__", "hashlib", "hmac", "time",
                                         "collections", "typing", "msgspec"}


def test_proxy_imports_neither_router_nor_engine_shim() -> None:
    for path in PKG.glob("*.py"):
        assert not _imports(path) & {"router", "engine_shim"}, path.name


def test_public_api_is_exported() -> None:
    assert sorted(proxy.__all__) == sorted(set(proxy.__all__))
    for name in proxy.__all__:
        assert getattr(proxy, name) is not None, name
