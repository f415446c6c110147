"""pdgate's `kv_transfer_params` contract (contract/kv_contract.py): what the router writes with
`to_params()` parses back to the same struct on every leg, a missing version reads as 1, a
newer one is refused, every bad key is refused by name, and the table in docs/flows.md lists
exactly the keys each leg's struct sends."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdgate.contract.kv_contract import (
    KV_PARAMS_VERSION,
    NOTIFY_TOKEN_MAX_CHARS,
    Continuation,
    KVParamsError,
    NotifyDecodeParams,
    NotifyPrefillParams,
    PushDecodeParams,
    PushPrefillParams,
    parse_continuation,
    parse_pdgate_params,
    parse_version,
)
from pdgate.proxy.wire import MAX_TOKEN_LENGTH

# vLLM's keys that pick the leg; the router's leg bodies add them (router/flows/bodies.py).
P_ROLE = {"do_remote_decode": True, "do_remote_prefill": False}
D_ROLE = {"do_remote_prefill": True, "do_remote_decode": False}

NOTIFY_P = NotifyPrefillParams(
    remote_engine_id="d-1", remote_host="10.0.0.2", remote_port=5600, remote_block_ids=[3, 4],
    reservation_id="res-9", num_tokens=20, remote_agent_name="agent-d",
    notify_endpoint="tcp://10.0.0.9:7000", notify_request_id="req-1", notify_token="t" * 32,
    write_deadline=1_700_000_000.5)
NOTIFY_D = NotifyDecodeParams(reservation_id="res-9", num_tokens=20,
                              push_deadline=1_700_000_030.0)
PUSH_P = PushPrefillParams(num_tokens=20)
PUSH_D = PushDecodeParams(remote_engine_id="p-1", remote_host="10.0.0.1", remote_port=5601,
                          remote_agent_name="agent-p", num_tokens=20,
                          push_deadline=1_700_000_030.0, continue_after_prefill=True)
LEGS: dict[str, tuple[Any, dict[str, bool]]] = {
    "notify prefill": (NOTIFY_P, P_ROLE),
    "notify prefill, bare": (NotifyPrefillParams(
        remote_engine_id="d", remote_host="h", remote_port=1, remote_block_ids=[],
        reservation_id="r", num_tokens=0), P_ROLE),
    "notify decode": (NOTIFY_D, D_ROLE),
    "notify decode, bare": (NotifyDecodeParams(reservation_id="r"), D_ROLE),
    "push prefill": (PUSH_P, P_ROLE),
    "push prefill with proxy": (PushPrefillParams(
        num_tokens=0, notify_endpoint="tcp://h:1", notify_request_id="x", notify_token=""),
        P_ROLE),
    "push decode": (PUSH_D, D_ROLE),
    "push decode, bare": (PushDecodeParams(
        remote_engine_id="p", remote_host="h", remote_port=65535), D_ROLE),
}


@pytest.mark.parametrize("name", list(LEGS))
def test_to_params_parses_back_to_the_same_leg(name: str) -> None:
    leg, role = LEGS[name]
    params = leg.to_params()
    assert params["pdgate_mode"] == leg.mode
    assert params["pdgate_kv_version"] == KV_PARAMS_VERSION
    assert None not in params.values()
    # Through JSON, as on the wire, merged into vLLM's keys as the router does.
    wire = msgspec.json.decode(msgspec.json.encode({**role, **params}))
    assert parse_pdgate_params(wire) == leg


def test_to_params_is_the_router_dict_of_today() -> None:
    """The keys and values are today's, so the router can swap its literal for the struct."""
    assert PUSH_P.to_params() == {"pdgate_mode": "push", "pdgate_kv_version": 1,
                                  "num_tokens": 20}
    assert NotifyDecodeParams(reservation_id="r", num_tokens=3).to_params() == {
        "pdgate_mode": "notify", "pdgate_kv_version": 1, "reservation_id": "r",
        "num_tokens": 3}
    flag_off = PushDecodeParams(remote_engine_id="p", remote_host="h", remote_port=2)
    assert "continue_after_prefill" not in flag_off.to_params()


def test_a_continuation_round_trips_alone_and_on_a_notify_decode_leg() -> None:
    cont = Continuation(first_token_ids=[7, 0])
    assert parse_continuation(msgspec.json.decode(msgspec.json.encode(cont.to_params()))) \
        == cont
    both = {**D_ROLE, **NOTIFY_D.to_params(), **cont.to_params()}
    assert (parse_pdgate_params(both), parse_continuation(both)) == (NOTIFY_D, cont)
    assert parse_continuation({"first_token_ids": []}) is None
    assert parse_continuation({}) is None


@pytest.mark.parametrize("name", list(LEGS))
def test_a_missing_version_reads_as_1(name: str) -> None:
    leg, role = LEGS[name]
    params = {**role, **leg.to_params()}
    del params["pdgate_kv_version"]
    assert parse_version(params) == 1
    assert parse_pdgate_params(params) == leg


@pytest.mark.parametrize("version", [KV_PARAMS_VERSION + 1, 99])
def test_a_newer_version_is_refused_by_name(version: int) -> None:
    for leg, role in LEGS.values():
        with pytest.raises(KVParamsError, match="newer than this engine") as info:
            parse_pdgate_params({**role, **leg.to_params(), "pdgate_kv_version": version})
        assert info.value.field == "kv_transfer_params.pdgate_kv_version"
    with pytest.raises(KVParamsError, match="pdgate_kv_version"):
        parse_continuation({"first_token_ids": [1], "pdgate_kv_version": version})


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, True, [1]])
def test_a_malformed_version_is_refused_by_name(version: object) -> None:
    with pytest.raises(KVParamsError, match=r"pdgate_kv_version must be an int >= 1"):
        parse_version({"pdgate_kv_version": version})


def test_pull_and_roleless_params_are_not_pdgate_legs() -> None:
    """vLLM's pull protocol (no mode, or "pull") and a request with no role are left to
    their own parsers; so is a P reply, which carries the mode but neither role."""
    assert parse_pdgate_params({**D_ROLE, "remote_engine_id": "p"}) is None
    assert parse_pdgate_params({**P_ROLE, "pdgate_mode": "pull"}) is None
    assert parse_pdgate_params({"pdgate_mode": "push", "do_remote_prefill": False,
                                "do_remote_decode": False, "num_tokens": 3}) is None


# (leg, key, bad value, what the message says after "kv_transfer_params.<key> ")
BAD: list[tuple[str, str, object, str]] = [
    ("notify prefill", "remote_engine_id", None, "must be a non-empty string, got None"),
    ("notify prefill", "remote_engine_id", "", "must be a non-empty string, got ''"),
    ("notify prefill", "remote_host", 5, "must be a non-empty string, got 5"),
    ("notify prefill", "remote_port", 0, "must be an int in 1..65535, got 0"),
    ("notify prefill", "remote_port", 65536, "must be an int in 1..65535, got 65536"),
    ("notify prefill", "remote_port", "5600", "must be an int in 1..65535, got '5600'"),
    ("notify prefill", "remote_port", True, "must be an int in 1..65535, got True"),
    ("notify prefill", "remote_block_ids", [1, -1], "must be a list of ints >= 0"),
    ("notify prefill", "remote_block_ids", [1, True], "must be a list of ints >= 0"),
    ("notify prefill", "remote_block_ids", None, "must be a list of ints >= 0, got None"),
    ("notify prefill", "reservation_id", 7, "must be a non-empty string, got 7"),
    ("notify prefill", "num_tokens", -1, "must be an int >= 0, got -1"),
    ("notify prefill", "num_tokens", 2.5, "must be an int >= 0, got 2.5"),
    ("notify prefill", "remote_agent_name", 3, "must be a non-empty string, got 3"),
    ("notify prefill", "notify_endpoint", ["tcp://x"], "must be a non-empty string"),
    ("notify prefill", "notify_request_id", 1, "must be a non-empty string, got 1"),
    ("notify prefill", "notify_token", "t" * (NOTIFY_TOKEN_MAX_CHARS + 1),
     "must be a string of at most 128 characters, got 129 characters"),
    ("notify prefill", "notify_token", 7, "must be a string of at most 128 characters"),
    ("notify prefill", "write_deadline", "soon", "must be a finite time >= 0"),
    ("notify prefill", "write_deadline", float("inf"), "must be a finite time >= 0"),
    ("notify prefill", "write_deadline", -5, "must be a finite time >= 0"),
    ("notify decode", "reservation_id", None, "must be a non-empty string, got None"),
    ("notify decode", "num_tokens", "20", "must be an int >= 0, got '20'"),
    ("notify decode", "push_deadline", float("nan"), "must be a finite time >= 0"),
    ("notify decode", "continue_after_prefill", True, "needs a decode leg with pdgate_mode "
     "push"),
    ("push prefill", "num_tokens", None, "must be an int >= 0, got None"),
    ("push prefill", "notify_token", ["t"], "must be a string of at most 128 characters"),
    ("push prefill", "continue_after_prefill", True, "needs a decode leg"),
    ("push decode", "remote_engine_id", None, "must be a non-empty string, got None"),
    ("push decode", "remote_host", "", "must be a non-empty string, got ''"),
    ("push decode", "remote_port", -1, "must be an int in 1..65535, got -1"),
    ("push decode", "push_deadline", True, "must be a finite time >= 0"),
    ("push decode", "continue_after_prefill", "yes", "must be a boolean, got 'yes'"),
    ("push decode", "pdgate_mode", "teleport", "must be one of notify, push"),
    ("push decode", "first_token_ids", [1, "2"], "must be a list of ints >= 0"),
    ("push decode", "first_token_ids", 5, "must be a list of ints >= 0, got 5"),
    ("push prefill", "first_token_ids", [5], "is for the decode leg"),
]


@pytest.mark.parametrize(("leg", "key", "value", "message"), BAD,
                         ids=[f"{leg}-{key}-{value!r}"[:60] for leg, key, value, _ in BAD])
def test_a_bad_key_is_refused_naming_it(leg: str, key: str, value: object,
                                        message: str) -> None:
    struct, role = LEGS[leg]
    params = {**role, **struct.to_params(), key: value}
    with pytest.raises(KVParamsError) as info:
        parse_pdgate_params(params)
        parse_continuation(params)
    assert info.value.field == f"kv_transfer_params.{key}"
    assert str(info.value).startswith(f"kv_transfer_params.{key} {message}"), info.value
    assert isinstance(info.value, ValueError)


def test_a_huge_bad_value_is_not_echoed_whole() -> None:
    with pytest.raises(KVParamsError) as info:
        parse_pdgate_params({**P_ROLE, **PUSH_P.to_params(), "notify_endpoint": ["x" * 10_000]})
    assert len(str(info.value)) < 200


def test_the_token_limit_is_what_the_kv_ready_notice_carries() -> None:
    assert NOTIFY_TOKEN_MAX_CHARS == MAX_TOKEN_LENGTH


def _docs_table() -> dict[str, set[str]]:
    """docs/flows.md's key table: key -> the legs its "legs" column names."""
    text = (Path(__file__).parents[2] / "docs" / "flows.md").read_text()
    section = text.split("## pdgate's kv_transfer_params extension", 1)[1]
    rows: dict[str, set[str]] = {}
    for line in section.split("\n## ", 1)[0].splitlines():
        m = re.match(r"\| `([a-z_]+)` \| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = {leg.strip() for leg in m.group(2).split(",")}
    return rows


@pytest.mark.parametrize(("cls", "column"), [
    (NotifyPrefillParams, "notify P"), (NotifyDecodeParams, "notify D"),
    (PushPrefillParams, "push P"), (PushDecodeParams, "push D"),
    (Continuation, "continuation"),
])
def test_the_docs_table_lists_each_legs_keys(cls: type[msgspec.Struct], column: str) -> None:
    documented = {key for key, legs in _docs_table().items() if column in legs}
    fields = set(cls.__struct_fields__) | {"pdgate_kv_version"}
    if cls is not Continuation:
        fields.add("pdgate_mode")
    assert documented == fields


def test_the_docs_version_history_ends_at_the_current_version() -> None:
    text = (Path(__file__).parents[2] / "docs" / "flows.md").read_text()
    section = text.split("## pdgate's kv_transfer_params extension", 1)[1]
    versions = [int(v) for v in re.findall(r"^- \*\*v(\d+)\*\*", section, re.M)]
    assert versions == list(range(1, KV_PARAMS_VERSION + 1))
