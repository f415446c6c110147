"""Every flow's leg bodies come from router/flows/bodies.py: one table of what each leg sends."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdgate.router.flows.bodies import decode_leg_body, prefill_leg_body, remote_prefill

CLIENT: dict[str, Any] = {
    "model": "m", "prompt": "hi", "max_tokens": 9, "stream": True, "min_tokens": 2,
    "stream_options": {"include_usage": True}, "kv_transfer_params": {"client": "sent"},
}
NO_REMOTE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}
P_REPLY = {"do_remote_prefill": True, "remote_engine_id": "P0", "remote_block_ids": [1]}


@pytest.mark.parametrize(("built", "expected"), [
    # pull prefill: one token, no stream, P keeps the KV; client-only fields dropped
    (prefill_leg_body(CLIENT), {"model": "m", "prompt": "hi", "max_tokens": 1,
                                "stream": False, "kv_transfer_params": NO_REMOTE}),
    # notify/push prefill: the flow's keys added
    (prefill_leg_body(CLIENT, {"pdgate_mode": "push", "num_tokens": 3}),
     {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
      "kv_transfer_params": {**NO_REMOTE, "pdgate_mode": "push", "num_tokens": 3}}),
    # max_completion_tokens is capped too when the client used it
    (prefill_leg_body({"messages": [], "max_completion_tokens": 50}),
     {"messages": [], "max_completion_tokens": 1, "max_tokens": 1, "stream": False,
      "kv_transfer_params": NO_REMOTE}),
    # pull decode: P's params as an opaque blob, the rest as the client sent it
    (decode_leg_body(CLIENT, P_REPLY), {**CLIENT, "kv_transfer_params": P_REPLY}),
    # fallback decode: no params at all, even the client's own
    (decode_leg_body(CLIENT, None), {k: v for k, v in CLIENT.items()
                                     if k != "kv_transfer_params"}),
    # notify/push decode: "the KV comes from P" plus the flow's keys
    (decode_leg_body(CLIENT, remote_prefill({"pdgate_mode": "notify", "reservation_id": "r"})),
     {**CLIENT, "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "pdgate_mode": "notify", "reservation_id": "r"}}),
])
def test_leg_bodies(built: bytes, expected: dict[str, Any]) -> None:
    assert json.loads(built) == expected


def test_the_clients_body_is_never_modified() -> None:
    before = json.dumps(CLIENT, sort_keys=True)
    prefill_leg_body(CLIENT, {"x": 1})
    decode_leg_body(CLIENT, None)
    decode_leg_body(CLIENT, P_REPLY)
    assert json.dumps(CLIENT, sort_keys=True) == before
