"""The engine error map (router/engines/error_map.py), row by row: each engine status and
body, and each transport failure, becomes one router error class with one HTTP status."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdgate.router.engines.error_map import check_status, translate
from pdgate.router.engines.http11 import BadResponse, ConnectFailed, Dropped
from pdgate.router.errors import (
    EngineError,
    EngineMisconfigured,
    EngineProtocolError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    RouterError,
)

URL = "http://engine:8000"
COMPLETION = "/v1/completions"
SENT = json.dumps({"model": "m", "prompt": "hi", "kv_transfer_params": {
    "do_remote_decode": True, "remote_block_ids": None}}).encode()
RESERVE_SENT = json.dumps({"request_id": "r", "num_tokens": 3}).encode()


def err(message: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "X", "param": param}}).encode()


# (engine status, engine body, route, router error class, HTTP status the client gets)
TABLE: list[tuple[int, bytes, str, bytes, type[RouterError], int]] = [
    (500, err("boom"), COMPLETION, SENT, EngineError, 502),
    (503, b"not json", COMPLETION, SENT, EngineError, 502),
    (302, b"", COMPLETION, SENT, EngineError, 502),
    (401, err("bad key"), COMPLETION, SENT, EngineMisconfigured, 502),
    (403, b"", COMPLETION, SENT, EngineMisconfigured, 502),
    (431, b"", COMPLETION, SENT, EngineMisconfigured, 502),
    (404, err("no route"), COMPLETION, SENT, EngineMisconfigured, 502),
    (404, err("no route"), "/v1/kv/reserve", RESERVE_SENT, EngineRejected, 404),
    (400, err("kv_transfer_params.remote_block_ids missing"), COMPLETION, SENT,
     EngineMisconfigured, 502),
    (422, json.dumps({"detail": [{"loc": ["body", "num_tokens"], "msg": "bad"}]}).encode(),
     "/v1/kv/reserve", RESERVE_SENT, EngineMisconfigured, 502),
    (400, err("prompt is too long", "prompt"), COMPLETION, SENT, EngineRejected, 400),
    (429, err("slow down"), COMPLETION, SENT, EngineRejected, 429),
    (413, b"", COMPLETION, SENT, EngineRejected, 413),
]


@pytest.mark.parametrize(("status", "body", "path", "sent", "cls", "http"), TABLE)
def test_each_engine_status_maps_to_one_router_error(
    status: int, body: bytes, path: str, sent: bytes, cls: type[RouterError], http: int,
) -> None:
    with pytest.raises(RouterError) as caught:
        check_status(URL, path, status, body, sent)
    assert type(caught.value) is cls
    assert caught.value.status == http


def test_a_2xx_is_no_error() -> None:
    check_status(URL, COMPLETION, 200, b"{}", SENT)


# (what the HTTP client raised, router error class, HTTP status)
TRANSPORT: list[tuple[BaseException, type[RouterError], int]] = [
    (TimeoutError(), EngineTimeout, 504),
    (ConnectFailed("refused"), EngineUnavailable, 502),
    (Dropped("reset"), EngineUnavailable, 502),
    (BadResponse("garbage"), EngineError, 502),
]


@pytest.mark.parametrize(("raised", "cls", "http"), TRANSPORT)
def test_each_transport_failure_maps_to_one_router_error(
    raised: BaseException, cls: type[RouterError], http: int,
) -> None:
    with pytest.raises(RouterError) as caught, translate(URL, "prefill"):
        raise raised
    assert type(caught.value) is cls and caught.value.status == http
    assert URL in caught.value.message
    if isinstance(raised, ConnectFailed):
        assert isinstance(caught.value, EngineUnavailable) and caught.value.connect_failed


def test_router_errors_pass_through_unchanged() -> None:
    original: Any = EngineProtocolError("not the protocol")
    with pytest.raises(EngineProtocolError) as caught, translate(URL, "prefill"):
        raise original
    assert caught.value is original
