"""1P1D over real NIXL (UCX on loopback): request ids that look like notices, non-ASCII ids
and very long ids, in pull and push mode; the router's notify token in notify mode.

The old text notifications told kinds apart by prefix (`pdgate:reg:` ...), and P read any
notification starting with `pdgate:` as a push notice, so D's pull "done" notice for a
request id starting with `pdgate:` was dropped and P's blocks stayed pinned until the lease
expired (60 s here). Now every request gets the colocated answer, and P's blocks (and D's)
are back in the pool right after the transfer, with no protocol error counted.

Notify mode: P echoes the router's `notify_token` in its KV-ready notice, and a waiter
registered with the token (as the router registers it) is woken by it.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from pdgate.engine_shim.cli import ConnectorSettings, nixl_connector_factory
from pdgate.proxy import NotifyServer, ProxyConfig
from tests.engine_shim.live import BLOCK_SIZE, MODEL, NUM_BLOCKS, Shim, start_shim, stop_shim

# X-Request-Id values (bytes: sent as they are; the server reads them as latin-1 text).
IDS: dict[str, bytes] = {
    "reg-prefix": b"pdgate:reg:evil",
    "landed-prefix": b"pdgate:landed:x",
    "unreg-prefix": b"pdgate:unreg:y",
    "bare-prefix": b"pdgate:",
    "non-ascii": "prüfung-日本-🚀".encode(),
    "long": b"pdgate:" + b"x" * 4000,
}
FRESH_S = 5.0  # "right after the transfer": far below the 60 s lease


def _shim(model_dir: Path, engine_id: str) -> Shim:
    factory = nixl_connector_factory(ConnectorSettings(
        engine_id=engine_id, side_channel_host="127.0.0.1", side_channel_port=0,
        lease_seconds=60.0))
    return start_shim(model_dir, connector_factory=factory)


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> Iterator[tuple[Shim, Shim]]:
    p = _shim(tiny_model_dir, "p-ids")
    d = _shim(tiny_model_dir, "d-ids")
    yield p, d
    stop_shim(p)
    stop_shim(d)


@pytest.fixture(scope="module")
def count_tokens(tiny_model_dir: Path) -> Any:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return lambda prompt: len(tok(prompt).input_ids)


def _body(prompt: str, max_tokens: int, params: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "kv_transfer_params": params}


def _post(shim: Shim, body: dict[str, Any], rid: bytes) -> dict[str, Any]:
    r = httpx.post(shim.url + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                   timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _metric(shim: Shim, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(shim.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _assert_pools_freed_at_once(*shims: Shim) -> None:
    deadline = time.monotonic() + FRESH_S
    for shim in shims:
        while shim.metric("pdgate_shim_kv_blocks_free") != NUM_BLOCKS:
            assert time.monotonic() < deadline, \
                f"{shim.url}: blocks still held {FRESH_S}s after the transfer"
            time.sleep(0.02)
        assert shim.metric("pdgate_shim_kv_blocks_leased") == 0
        assert _metric(shim, "pdgate_shim_kv_leases_expired_total") == 0
        assert _metric(shim, "pdgate_shim_protocol_errors_total") == 0


def _colocated(shim: Shim, prompt: str, n: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True}
    return str(_post(shim, body, b"colocated-" + str(time.monotonic_ns()).encode())
               ["choices"][0]["text"])


def _recomputes(shim: Shim) -> float:
    return _metric(shim, "pdgate_shim_requests_total", 'status="recompute"')


@pytest.mark.parametrize("name", list(IDS))
def test_pull_with_hostile_request_ids(pair: tuple[Shim, Shim], name: str) -> None:
    p, d = pair
    rid, prompt = IDS[name], f"The pull of {name} reads every block of this prompt."
    released = _metric(p, "pdgate_shim_kv_leases_released_total")
    recomputed = _recomputes(d)
    held = _post(p, _body(prompt, 1, {"do_remote_decode": True}), rid)
    params = held["kv_transfer_params"]
    assert params["remote_request_id"] == rid.decode("latin-1")
    n_blocks = -(-held["usage"]["prompt_tokens"] // BLOCK_SIZE)
    assert p.metric("pdgate_shim_kv_blocks_leased") == n_blocks
    out = _post(d, _body(prompt, 8, params), rid)
    _assert_pools_freed_at_once(p, d)  # D's "done" notice released P's lease
    assert _metric(p, "pdgate_shim_kv_leases_released_total") == released + 1
    assert _recomputes(d) == recomputed  # the KV was read, not recomputed
    assert out["choices"][0]["text"] == _colocated(d, prompt, 8)


@pytest.mark.parametrize("name", list(IDS))
def test_push_with_hostile_request_ids(pair: tuple[Shim, Shim], count_tokens: Any,
                                       name: str) -> None:
    p, d = pair
    rid, prompt = IDS[name], f"The push of {name} writes every block of this prompt."
    info = httpx.get(p.url + "/v1/kv/info", timeout=10).json()
    n = count_tokens(prompt)
    written = _metric(p, "pdgate_shim_kv_transfers_total", 'op="write"')
    recomputed = _recomputes(d)
    p_params = {"do_remote_decode": True, "pdgate_mode": "push", "num_tokens": n}
    d_params = {"do_remote_prefill": True, "pdgate_mode": "push", "num_tokens": n,
                "remote_engine_id": info["engine_id"], "remote_host": info["host"],
                "remote_port": info["port"], "remote_agent_name": info["agent_name"]}
    with ThreadPoolExecutor(2) as pool:  # both legs at once, as the router sends them
        d_leg = pool.submit(_post, d, _body(prompt, 8, d_params), rid)
        p_leg = pool.submit(_post, p, _body(prompt, 1, p_params), rid)
        out, held = d_leg.result(), p_leg.result()
    assert held["kv_transfer_params"]["pdgate_mode"] == "push"
    _assert_pools_freed_at_once(p, d)
    assert _metric(p, "pdgate_shim_kv_transfers_total", 'op="write"') == written + 1
    assert _recomputes(d) == recomputed  # D registered, P wrote, D saw the landing
    assert out["choices"][0]["text"] == _colocated(d, prompt, 8)


async def test_notify_echoes_the_router_token(pair: tuple[Shim, Shim],
                                              count_tokens: Any) -> None:
    p, d = pair
    rid, token = "pdgate:landed:notify", secrets.token_hex(16)
    prompt = "The notify flow writes into blocks the router reserved on the decode engine."
    n = count_tokens(prompt)
    async with NotifyServer(ProxyConfig(bind="tcp://127.0.0.1:0")) as px:
        slot = httpx.post(d.url + "/v1/kv/reserve", json={"request_id": rid, "num_tokens": n},
                          timeout=10).json()
        px.waiters.register(rid, token)  # only a notice with this token wakes it
        p_params = {
            "do_remote_decode": True, "pdgate_mode": "notify", "num_tokens": n,
            "remote_engine_id": slot["engine_id"], "remote_host": slot["host"],
            "remote_port": slot["port"], "remote_agent_name": slot["agent_name"],
            "remote_block_ids": slot["block_ids"], "reservation_id": slot["reservation_id"],
            "notify_endpoint": px.advertised_endpoint, "notify_request_id": rid,
            "notify_token": token, "write_deadline": time.time() + 30,
        }
        prefill = asyncio.create_task(asyncio.to_thread(
            _post, p, _body(prompt, 1, p_params), rid.encode()))
        ready = await px.waiters.wait(rid, 10.0)
        await prefill
    assert (ready.token, ready.status, ready.num_tokens) == (token, "ok", n)
    d_params = {"do_remote_prefill": True, "pdgate_mode": "notify", "num_tokens": n,
                "reservation_id": slot["reservation_id"]}
    out = await asyncio.to_thread(_post, d, _body(prompt, 8, d_params), rid.encode())
    _assert_pools_freed_at_once(p, d)
    assert out["choices"][0]["text"] == await asyncio.to_thread(_colocated, d, prompt, 8)
