"""Property-based fuzzing: random and malformed input never gets a 5xx or a hang.

The router has no OpenAPI schema (its routes are plain Starlette handlers, `openapi_url=None`),
so instead of schemathesis this drives hypothesis-generated bodies — random JSON, the real
field names with random values, raw bytes — at a real router (uvicorn on loopback, behind
recording fake engines) from a background thread. The shim's side channel gets random frames
on a real ZMQ socket and must keep answering valid handshakes; its reply decoder must turn any
bytes into `KVHandshakeError`, nothing else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdgate.engine_shim.kv_layout import KVLayout
from pdgate.engine_shim.side_channel import (
    SIDE_CHANNEL_VERSION,
    HandshakePayload,
    SideChannelServer,
    compat_hash,
    decode_reply,
    fetch_handshake,
)
from pdgate.engine_shim.transfer_errors import KVHandshakeError
from pdgate.router.input.tokenization import PromptTokenizer
from tests.router.conftest import MODEL, router_config, serve
from tests.router.fake_engine import FakeEngine

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "n", "stream", "stream_options", "stop", "logprobs", "echo", "seed",
          "kv_transfer_params", "min_tokens", "user", "response_format", "tools", "role",
          "content", "chat_template_kwargs", "add_generation_prompt", "ignore_eos"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=30)
    | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([MODEL, "x", ""]),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_options = {
    "max_tokens": st.integers(1, 16), "temperature": st.floats(0, 2), "stream": st.booleans(),
    "n": st.integers(1, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**31),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=2),
    "stream_options": st.just({"include_usage": True}),
}
completion = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.text(max_size=40)
     | st.lists(st.integers(0, 500), min_size=1, max_size=8)}, optional=_options)
chat = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]),
         "content": st.text(max_size=20)}), min_size=1, max_size=3)}, optional=_options)
valid = completion | chat
# A valid body with one field replaced by anything: reaches the deeper validation paths.
mutated = st.tuples(valid, st.sampled_from(FIELDS), json_values).map(
    lambda t: {**t[0], t[1]: t[2]})
# Hostile bodies (router/input/limits.py): nesting far beyond max_json_depth (arrays, objects,
# both, unclosed) wherever a value may go, and strings that are not UTF-8 — overlong
# forms, encoded surrogates, code points past U+10FFFF, truncated sequences, stray bytes —
# or hold unpaired \ud800-style escapes, in values and keys.
MARK = "\u2603MARK\u2603"
_marked = (st.fixed_dictionaries({"model": st.just(MODEL), "prompt": st.just(MARK)},
                                 optional=_options)
           | st.fixed_dictionaries({"model": st.just(MODEL),
                                    "messages": st.just([{"role": "user", "content": MARK}])},
                                   optional=_options)
           | st.just({"model": MODEL, MARK: 1, "prompt": "x"}))
_plain = st.text(st.characters(blacklist_characters='"\\', blacklist_categories=("Cs", "Cc")),
                 max_size=5)

def _nest(depth: int, kind: str, closed: bool) -> bytes:
    opener = {"[": b"[", "{": b'{"a": ', "mixed": b'[{"a": '}[kind]
    closer = {"[": b"]", "{": b"}", "mixed": b"}]"}[kind]
    return opener * depth + b"1" + (closer * depth if closed else b"")


def _splice(body: dict[str, Any], payload: bytes, quoted: bool) -> bytes:
    marker = msgspec.json.encode(MARK)
    return msgspec.json.encode(body).replace(marker, b'"' + payload + b'"' if quoted
                                             else payload)


depth_bombs = st.builds(
    lambda body, depth, kind, closed: _splice(body, _nest(depth, kind, closed), False),
    _marked.filter(lambda b: MARK not in b), st.integers(20, 3000),
    st.sampled_from(["[", "{", "mixed"]), st.booleans())
bad_utf8 = st.sampled_from([
    b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf",  # overlong
    b"\xed\xa0\x80", b"\xed\xbf\xbf",  # encoded surrogates
    b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80",  # past U+10FFFF
    b"\xe2\x82", b"\xff", b"\xfe", b"\x80"])  # truncated, stray
lone_surrogates = st.sampled_from([b"\\ud800", b"\\udfff", b"\\ud800x", b"\\udc00\\ud800",
                                   b"\\uDBFF\\u0041"])
broken_strings = st.builds(
    lambda body, bad, pre, post: _splice(body, pre.encode() + bad + post.encode(), True),
    _marked, bad_utf8 | lone_surrogates, _plain, _plain)
hostile = depth_bombs | broken_strings
bodies = (valid.map(msgspec.json.encode) | mutated.map(msgspec.json.encode)
          | json_values.map(msgspec.json.encode) | st.binary(max_size=200)
          | st.text(max_size=100).map(str.encode) | hostile)


@pytest.fixture(scope="module")
def router_url(tiny_model_dir: Path, tokenizer: PromptTokenizer) -> Iterator[str]:
    """A router plus fake engines, on an event loop in a background thread."""
    url: list[str] = []
    ready, stop = threading.Event(), threading.Event()

    async def main() -> None:
        engines = [FakeEngine(), FakeEngine()]
        for e in engines:
            await e.start()
        config = router_config(tiny_model_dir, engines[:1], engines[1:])
        try:
            async with serve(config, tokenizer) as router:
                url.append(router.url)
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.05)
        finally:
            for e in engines:
                await e.stop()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(60), "router did not start"
    yield url[0]
    stop.set()
    thread.join(30)


@pytest.fixture(scope="module")
def client(router_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router_url, timeout=10.0) as c:
        yield c


def _check(resp: httpx.Response) -> None:
    event(f"HTTP {resp.status_code}")  # the status mix: --hypothesis-show-statistics
    assert resp.status_code < 500, (resp.status_code, resp.text)
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["type"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_random_bodies_never_get_a_5xx(client: httpx.Client, path: str, body: bytes) -> None:
    _check(client.post(path, content=body, headers={"Content-Type": "application/json"}))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=hostile)
def test_hostile_bodies_get_a_400(client: httpx.Client, path: str, body: bytes) -> None:
    resp = client.post(path, content=body, headers={"Content-Type": "application/json"})
    _check(resp)
    if resp.status_code != 200:  # shallow enough and valid: may be served
        assert resp.status_code == 400, (resp.status_code, resp.text)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/ready",
                          "/admin/engines", "/v1/../health", "/%00", "/v1/completions/x"]),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    headers=st.dictionaries(
        st.sampled_from(["content-type", "authorization", "x-request-id", "traceparent",
                         "content-encoding", "accept"]),
        st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
        max_size=3),
)
def test_random_methods_paths_and_headers(
    client: httpx.Client, path: str, method: str, headers: dict[str, str]
) -> None:
    resp = client.request(method, path, content=b'{"model": "tiny", "prompt": "x"}',
                          headers=headers)
    assert resp.status_code < 500, (resp.status_code, resp.text)


# --- the shim's side channel ------------------------------------------------------------

def _payload() -> HandshakePayload:
    layout = KVLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16)
    return HandshakePayload("fuzz", "agent", b"meta", 0, "DRAM", 0, layout, "m",
                            compat_hash("m", layout))


@given(st.binary(max_size=300))
def test_handshake_reply_decoder_only_raises_handshake_errors(frame: bytes) -> None:
    with contextlib.suppress(KVHandshakeError):
        decode_reply(frame)


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_handshake_reply_decoder_rejects_any_envelope_payload(parts: list[bytes]) -> None:
    env: dict[str, Any] = {"v": SIDE_CHANNEL_VERSION, "payload": b"".join(parts)}
    with contextlib.suppress(KVHandshakeError):
        decode_reply(msgspec.msgpack.encode(env))


SIDE_CHANNEL_COUNTS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module")
def side_channel() -> Iterator[SideChannelServer]:
    server = SideChannelServer("127.0.0.1", 0, _payload(),
                               on_request=lambda result: SIDE_CHANNEL_COUNTS.update([result]))
    server.start()
    yield server
    server.stop()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(st.binary(max_size=128), min_size=1, max_size=4))
def test_side_channel_survives_random_frames(
    side_channel: SideChannelServer, frames: list[bytes]
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{side_channel.port}")
        sock.send_multipart(frames)
        if len(frames) == 1 and sock.poll(2000, zmq.POLLIN):
            # One frame is a request: garbage gets an error envelope, never silence.
            with contextlib.suppress(KVHandshakeError):
                decode_reply(sock.recv())
        sock.close(linger=0)
    finally:
        ctx.term()
    # Whatever came before, a well-formed handshake is still answered.
    served = SIDE_CHANNEL_COUNTS["served"]
    assert fetch_handshake("127.0.0.1", side_channel.port, 5.0).engine_id == "fuzz"
    assert SIDE_CHANNEL_COUNTS["served"] == served + 1


def test_side_channel_counts_malformed_messages(side_channel: SideChannelServer) -> None:
    before = SIDE_CHANNEL_COUNTS.copy()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{side_channel.port}")
        sock.send_multipart([b"a", b"b"])  # three frames at the ROUTER: not a request
        sock.send(b"\xc1 not msgpack")
        assert sock.poll(5000, zmq.POLLIN)
        with pytest.raises(KVHandshakeError, match="malformed"):
            decode_reply(sock.recv())
        sock.close(linger=0)
    finally:
        ctx.term()
    assert SIDE_CHANNEL_COUNTS["malformed_frames"] == before["malformed_frames"] + 1
    assert SIDE_CHANNEL_COUNTS["malformed_request"] == before["malformed_request"] + 1
