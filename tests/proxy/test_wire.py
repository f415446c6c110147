"""The wire contract: round trips, two-phase decode errors, HMAC, LMCache compatibility."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

import proxy
from proxy.wire import (
    PROTOCOL_VERSION,
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
