"""Hostile request bodies get a 4xx with an OpenAI error body, never a 500, and cost no memory.

- A body over `--max-body-bytes` is a 413 at once when its Content-Length says so (nothing
  is read: the reply comes while the client has sent only the headers), and a chunked body
  is refused as soon as it crosses the limit, while the client is still sending.
- 100,000 nested JSON arrays or objects (msgspec raises RecursionError, even in fields typed
  `Any`) and invalid UTF-8 (UnicodeDecodeError) are 400s.
- pdgate's `kv_transfer_params` keys (contract/kv_contract.py) are checked at the edge: a bad
  field (e.g. `notify_token` over 128 chars, a `remote_port` out of range) or a
  `pdgate_kv_version` newer than the engine's is a 400 whose `param` names the key.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest

from pdgate.engine_shim.server import ServerSettings
from tests.engine_shim.live import MODEL, Shim, start_shim, stop_shim

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def shim(tiny_model_dir: Path) -> Iterator[Shim]:
    s = start_shim(tiny_model_dir, settings=ServerSettings(max_body_bytes=LIMIT))
    yield s
    stop_shim(s)


def _connect(shim: Shim) -> socket.socket:
    parts = urlsplit(shim.url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def _read_reply(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a reply: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ", 2)[1]), msgspec.json.decode(body[:length])


def _refused_count(shim: Shim) -> float:
    for line in httpx.get(shim.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('pdgate_shim_http_refused_total{reason="body_too_large"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_announced_oversized_body_is_refused_before_it_is_sent(shim: Shim) -> None:
    before = _refused_count(shim)
    with _connect(shim) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 200000000\r\n\r\n")
        status, body = _read_reply(sock)  # no body byte sent: the server did not wait for it
    assert status == 413
    assert body == {"error": {
        "message": f"request body too large: the limit is {LIMIT} bytes, got 200000000 bytes",
        "type": "RequestTooLargeError", "param": None, "code": 413}}
    assert _refused_count(shim) == before + 1


def test_a_chunked_body_is_refused_once_it_crosses_the_limit(shim: Shim) -> None:
    chunk = b"[" + b"1," * 32767 + b"1]"  # ~64 KiB of JSON-ish text
    sent = 0
    with _connect(shim) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        deadline = time.monotonic() + 30
        while not select.select([sock], [], [], 0.01)[0]:
            assert time.monotonic() < deadline and sent < 8 * LIMIT, "no early refusal"
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        status, body = _read_reply(sock)
    assert status == 413 and body["error"]["type"] == "RequestTooLargeError"
    # Refused within a few chunks of the limit, long before the body's end (never sent).
    assert LIMIT < sent < LIMIT + 16 * len(chunk)


def test_a_body_under_the_limit_is_served(shim: Shim) -> None:
    r = httpx.post(shim.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True,
        "user": "x" * (LIMIT // 2)})
    assert r.status_code == 200, r.text


DEEP = 100_000
NESTED_ARRAYS = b"[" * DEEP + b"]" * DEEP
NESTED_OBJECTS = b'{"a":' * DEEP + b"1" + b"}" * DEEP


def _completion(field: bytes, value: bytes) -> bytes:
    return b'{"model": "%s", "max_tokens": 2, "prompt": "Hi", %s: %s}' % (
        MODEL.encode(), field, value)


HOSTILE: dict[str, tuple[str, bytes, str]] = {
    "nested-prompt": ("/v1/completions",
                      b'{"model": "tiny", "max_tokens": 2, "prompt": ' + NESTED_ARRAYS + b"}",
                      "nested too deeply"),
    "nested-kv-params": ("/v1/completions", _completion(b'"kv_transfer_params"',
                                                        b'{"x": ' + NESTED_ARRAYS + b"}"),
                         "nested too deeply"),
    "nested-objects": ("/v1/completions", _completion(b'"kv_transfer_params"', NESTED_OBJECTS),
                       "nested too deeply"),
    "nested-chat-content": ("/v1/chat/completions",
                            b'{"model": "tiny", "messages": [{"role": "user", "content": '
                            b'[{"type": "text", "text": "Hi", "x": ' + NESTED_ARRAYS + b"}]}]}",
                            "nested too deeply"),
    "nested-abort": ("/v1/kv/abort", b'{"request_id": "r", "x": ' + NESTED_ARRAYS + b"}",
                     "nested too deeply"),
    "bad-utf8-prompt": ("/v1/completions",
                        b'{"model": "tiny", "max_tokens": 2, "prompt": "Hi \xff\xfe there"}',
                        "not valid UTF-8"),
    "bad-utf8-chat": ("/v1/chat/completions",
                      b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3("}]}',
                      "not valid UTF-8"),
    "bad-utf8-key": ("/v1/completions", b'{"model": "tiny", "prompt": "Hi", "\xed\xa0\x80": 1}',
                     "not valid UTF-8"),
    "lone-surrogate-escape": ("/v1/completions",
                              b'{"model": "tiny", "max_tokens": 2, "prompt": "\\ud800"}',
                              "not valid JSON"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_json_is_a_400_not_a_500(shim: Shim, name: str) -> None:
    path, body, message = HOSTILE[name]
    assert len(body) < LIMIT
    r = httpx.post(shim.url + path, content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    # The engine still serves.
    ok = httpx.post(shim.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200


# A complete notify P leg whose write deadline is long past: P hands nothing to D (no D
# listens at that side channel), yet the request itself is valid.
P_LEG = {"do_remote_decode": True, "pdgate_mode": "notify", "notify_request_id": "r",
         "remote_engine_id": "d", "remote_host": "127.0.0.1", "remote_port": 9,
         "remote_block_ids": [0], "reservation_id": "res-1", "num_tokens": 1,
         "write_deadline": 1.0}
TOKEN_RULE = "kv_transfer_params.notify_token must be a string of at most 128 characters"


@pytest.mark.parametrize(("token", "message"), [
    (7, f"{TOKEN_RULE}, got 7"),
    (["t"], f"{TOKEN_RULE}, got ['t']"),
    ("t" * 129, f"{TOKEN_RULE}, got 129 characters"),
])
def test_a_bad_notify_token_is_a_400_naming_it(shim: Shim, token: Any, message: str) -> None:
    r = httpx.post(shim.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 1,
        "kv_transfer_params": {**P_LEG, "notify_token": token}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_transfer_params.notify_token"
    assert message in r.json()["error"]["message"]


def test_a_notify_token_of_128_chars_is_accepted(shim: Shim) -> None:
    r = httpx.post(shim.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 1,
        "kv_transfer_params": {**P_LEG, "notify_token": "t" * 128}})
    assert r.status_code == 200, r.text


# What a push decode leg needs, valid: each case below spoils one key.
D_LEG = {"do_remote_prefill": True, "pdgate_mode": "push", "remote_engine_id": "p",
         "remote_host": "127.0.0.1", "remote_port": 9, "num_tokens": 1}


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"pdgate_kv_version": 2}, "pdgate_kv_version", "2 is newer than this engine understands"),
    ({"pdgate_kv_version": "1"}, "pdgate_kv_version", "must be an int >= 1, got '1'"),
    ({"remote_port": 70000}, "remote_port", "must be an int in 1..65535, got 70000"),
    ({"remote_host": None}, "remote_host", "must be a non-empty string, got None"),
    ({"push_deadline": "soon"}, "push_deadline", "must be a finite time >= 0"),
    ({"pdgate_mode": "teleport"}, "pdgate_mode", "must be one of notify, push"),
    ({"pdgate_mode": "notify"}, "reservation_id", "must be a non-empty string, got None"),
    ({"first_token_ids": [1, -2]}, "first_token_ids", "must be a list of ints >= 0"),
])
def test_a_bad_pdgate_key_is_a_400_naming_it(shim: Shim, change: dict[str, Any], field: str,
                                             message: str) -> None:
    r = httpx.post(shim.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 4, "kv_transfer_params": {
            **D_LEG, **change}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"kv_transfer_params.{field}"
    assert error["message"].startswith(f"kv_transfer_params.{field} {message}"), error
    assert (error["type"], error["code"]) == ("BadRequestError", 400)


def test_a_version_1_or_unversioned_leg_is_served(shim: Shim) -> None:
    """Senders older than `pdgate_kv_version` (no key) and version 1 both get an answer."""
    for extra in ({}, {"pdgate_kv_version": 1}):
        r = httpx.post(shim.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 1,
            "kv_transfer_params": {**P_LEG, **extra}})
        assert r.status_code == 200, r.text


def test_the_default_limit_is_16_mib_and_settable() -> None:
    from pdgate.engine_shim.cli import build_parser

    assert build_parser().parse_args([]).max_body_bytes == 16 << 20 == \
        ServerSettings().max_body_bytes
    assert build_parser().parse_args(["--max-body-bytes", "1024"]).max_body_bytes == 1024
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-body-bytes", "0"])
