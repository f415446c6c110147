"""Push mode over real NIXL (UCX on loopback), when P will not WRITE: D hears it at once.

A push-mode D registers its blocks with P and waits for P's landed notice. Before P's
`failed` notice existed, D learned nothing when P's WRITE failed, the router aborted the
request on P or P's prefill stopped early: it waited its whole transfer timeout (30 s, the
default these engines run with) before recomputing. Now P sends `failed{tag, reason}` and
D fails or recomputes (per `--kv-load-failure-policy`) within ~milliseconds; the tests
allow `REACTION_S`. A decode leg's `push_deadline` ends D's wait at that wall-clock time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from transformers import AutoTokenizer

from pdgate.engine_shim.cli import ConnectorSettings, nixl_connector_factory
from pdgate.engine_shim.connector import KVConnector
from tests.engine_shim.live import MODEL, Shim, start_shim, stop_shim

REACTION_S = 2.0  # far below the 30 s transfer timeout; generous for a shared 2-core VM
TRANSFER_TIMEOUT_S = 30.0  # the default: what D waited before P could say it gave up
SHORT = "A short prompt for the decode engine."
LONG = ("A much longer prompt that the prefill engine computes under the same request id, "
        "so its blocks do not fit the ones the decode engine registered for the push.")


def _shim(model_dir: Path, engine_id: str, policy: str = "recompute") -> Shim:
    factory = nixl_connector_factory(ConnectorSettings(
        engine_id=engine_id, side_channel_host="127.0.0.1", side_channel_port=0,
        lease_seconds=60.0, transfer_timeout=TRANSFER_TIMEOUT_S))
    return start_shim(model_dir, connector_factory=factory, kv_load_failure_policy=policy)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[Shim, Shim, Shim]]:
    """P, a recomputing D and a failing D."""
    shims = [_shim(tiny_model_dir, "p-fail"), _shim(tiny_model_dir, "d-recompute"),
             _shim(tiny_model_dir, "d-fail", "fail")]
    yield shims[0], shims[1], shims[2]
    for shim in shims:
        stop_shim(shim)


@pytest.fixture(scope="module")
def count_tokens(tiny_model_dir: Path) -> Any:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return lambda prompt: len(tok(prompt).input_ids)


def _body(prompt: str, max_tokens: int, params: dict[str, Any] | None,
          **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def _post(shim: Shim, body: dict[str, Any], rid: str) -> httpx.Response:
    return httpx.post(shim.url + "/v1/completions", json=body,
                      headers={"X-Request-Id": rid}, timeout=60)


def _timed(shim: Shim, body: dict[str, Any], rid: str) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = _post(shim, body, rid)
    return r, time.monotonic() - t0


def _d_params(p: Shim, n: int, **extra: Any) -> dict[str, Any]:
    info = httpx.get(p.url + "/v1/kv/info", timeout=10).json()
    return {"do_remote_prefill": True, "pdgate_mode": "push", "num_tokens": n,
            "remote_engine_id": info["engine_id"], "remote_host": info["host"],
            "remote_port": info["port"], "remote_agent_name": info["agent_name"], **extra}


def _p_params(n: int) -> dict[str, Any]:
    return {"do_remote_decode": True, "pdgate_mode": "push", "num_tokens": n}


def _pushes(p: Shim) -> int:
    return cast(KVConnector, p.engine.connector).pending_pushes()


def _wait_registered(p: Shim, count: int = 1) -> None:
    deadline = time.monotonic() + 20
    while _pushes(p) < count:
        assert time.monotonic() < deadline, "D's registration never reached P"
        time.sleep(0.005)


def _metric(shim: Shim, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(shim.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _peer_failures(d: Shim) -> float:
    return _metric(d, "pdgate_shim_kv_transfer_failures_total", 'reason="peer"')


def _colocated(shim: Shim, prompt: str, n: int) -> str:
    r = _post(shim, _body(prompt, n, None), f"colocated-{time.monotonic_ns()}")
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _assert_recomputed(r: httpx.Response, d: Shim, prompt: str) -> None:
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _colocated(d, prompt, 8)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_write_reaches_d_at_once(engines: tuple[Shim, Shim, Shim],
                                          count_tokens: Any, policy: str) -> None:
    """P's prompt (same request id) needs more blocks than D registered: P's WRITE fails
    ("params") and P says so; D recomputes (or fails with a 502) at once."""
    p, d_recompute, d_fail = engines
    d = d_recompute if policy == "recompute" else d_fail
    rid = f"write-fails-{policy}"
    failures = _metric(p, "pdgate_shim_kv_transfer_failures_total", 'op="write"')
    told = _peer_failures(d)
    with ThreadPoolExecutor(2) as pool:  # both legs at once, as the router sends them
        d_leg = pool.submit(_timed, d, _body(SHORT, 8, _d_params(p, count_tokens(SHORT))),
                            rid)
        p_leg = pool.submit(_post, p, _body(LONG, 1, _p_params(count_tokens(LONG))), rid)
        assert p_leg.result().status_code == 200
        r, elapsed = d_leg.result()
    print(f"\nD answered a failed WRITE ({policy}) after {elapsed * 1000:.0f} ms")
    assert elapsed < REACTION_S
    assert _metric(p, "pdgate_shim_kv_transfer_failures_total", 'op="write"') == failures + 1
    assert _peer_failures(d) == told + 1
    if policy == "recompute":
        _assert_recomputed(r, d, SHORT)
    else:
        assert r.status_code == 502 and r.json()["error"]["type"] == "KVTransferError"
    for shim in (p, d):
        shim.wait_pool_full()


def _register_then(p: Shim, d: Shim, rid: str, count_tokens: Any,
                   act: Any) -> tuple[httpx.Response, float]:
    """D's leg alone (P's never comes); once P holds D's registration, `act()`. Returns
    D's reply and how long after `act` it came."""
    with ThreadPoolExecutor(1) as pool:
        d_leg: Future[httpx.Response] = pool.submit(
            _post, d, _body(SHORT, 8, _d_params(p, count_tokens(SHORT))), rid)
        _wait_registered(p)
        t0 = time.monotonic()
        act()
        r = d_leg.result()
        return r, time.monotonic() - t0


def test_a_router_abort_on_p_reaches_d_at_once(engines: tuple[Shim, Shim, Shim],
                                               count_tokens: Any) -> None:
    p, d, _ = engines
    rid = "abort-after-registration"
    told = _peer_failures(d)
    r, elapsed = _register_then(p, d, rid, count_tokens, lambda: httpx.post(
        p.url + "/v1/kv/abort", json={"request_id": rid}, timeout=10).raise_for_status())
    print(f"\nD answered {elapsed * 1000:.0f} ms after the abort on P")
    assert elapsed < REACTION_S
    assert _peer_failures(d) == told + 1 and _pushes(p) == 0
    _assert_recomputed(r, d, SHORT)
    # A registration that comes after the abort is answered at once too.
    r, elapsed = _timed(d, _body(SHORT, 8, _d_params(p, count_tokens(SHORT))), rid)
    assert elapsed < REACTION_S and _peer_failures(d) == told + 2
    _assert_recomputed(r, d, SHORT)


def test_a_prefill_that_stops_early_reaches_d_at_once(engines: tuple[Shim, Shim, Shim],
                                                      count_tokens: Any) -> None:
    """P's first token is a stop token (every token is): it finishes without handing its
    KV over, as vLLM does when no KV is worth keeping."""
    p, d, _ = engines
    rid = "prefill-stops"
    every_token = list(range(p.engine.model.config.vocab_size))
    told = _peer_failures(d)

    def prefill() -> None:
        r = _post(p, _body(SHORT, 1, _p_params(count_tokens(SHORT)),
                           stop_token_ids=every_token), rid)
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json().get("kv_transfer_params") is None

    r, elapsed = _register_then(p, d, rid, count_tokens, prefill)
    print(f"\nD answered {elapsed * 1000:.0f} ms after P's leg started (it stopped early)")
    assert elapsed < REACTION_S and _peer_failures(d) == told + 1
    _assert_recomputed(r, d, SHORT)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_push_deadline_ends_d_wait(engines: tuple[Shim, Shim, Shim], count_tokens: Any,
                                   policy: str) -> None:
    """No P leg at all: D stops waiting at the router's push_deadline, and P drops the
    registration D then withdraws."""
    p, d_recompute, d_fail = engines
    d = d_recompute if policy == "recompute" else d_fail
    wait = 0.5
    params = _d_params(p, count_tokens(SHORT))
    params["push_deadline"] = deadline = time.time() + wait
    r = _post(d, _body(SHORT, 8, params), f"deadline-{policy}")
    late = time.time() - deadline  # when D's answer came, relative to the deadline
    print(f"\nD answered {late * 1000:+.0f} ms from a push_deadline {wait * 1000:.0f} ms "
          "after the leg was sent")
    assert 0 <= late < REACTION_S
    if policy == "recompute":
        _assert_recomputed(r, d, SHORT)
    else:
        assert r.status_code == 502
    deadline = time.monotonic() + 10
    while _pushes(p):  # D's unregistration reaches P
        assert time.monotonic() < deadline, "P still holds the withdrawn registration"
        time.sleep(0.01)
    d.wait_pool_full()


def test_a_bad_push_deadline_is_a_400(engines: tuple[Shim, Shim, Shim],
                                      count_tokens: Any) -> None:
    p, d, _ = engines
    for bad in ("soon", -1, True):
        params = _d_params(p, count_tokens(SHORT), push_deadline=bad)
        r = _post(d, _body(SHORT, 8, params), "bad-deadline")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "kv_transfer_params.push_deadline"
