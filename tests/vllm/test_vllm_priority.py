"""Request priority with REAL vLLM 0.32 engines run with `--scheduling-policy priority`.

This module starts its own P and D (pull mode, NixlConnector, `--scheduling-policy
priority`) behind recording relays (tests/vllm/recording.py) and a router with
`--forward-priority` and a client key mapped to a priority. Each test asserts what the
engines were asked (`priority` on the prefill AND the decode leg) and what the client got:
a 200 whose text equals D's own colocated answer (greedy), streamed and not. vLLM refuses
any priority other than 0 from an engine without priority scheduling, so the 200s also
show the engines received a priority they honour.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import completion_text
from tests.vllm.conftest import ENGINE_START_TIMEOUT_S
from tests.vllm.processes import (
    ENGINE_KEY,
    SERVED_NAME,
    Proc,
    start_router,
    start_vllm,
    wait_ready,
)
from tests.vllm.recording import Proxies, Recorder

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
OWN_ENGINES = True  # conftest.py: run before the session's shared engines start

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
KEY = "sk-priority-test-key"
COMPLETIONS = "/v1/completions"


@dataclass
class Rig:
    router: str
    d: Proc
    p_rec: Recorder
    d_rec: Recorder


@pytest.fixture(scope="module")
def rig(vllm_python: Path, vllm_model_dir: Path, vllm_log_dir: Path) -> Iterator[Rig]:
    prio = ["--scheduling-policy", "priority"]
    procs: list[Proc] = []
    proxies: Proxies | None = None
    try:
        procs.append(start_vllm(vllm_python, vllm_model_dir, "P-prio", vllm_log_dir,
                                core="0", extra_args=prio))
        procs.append(start_vllm(vllm_python, vllm_model_dir, "D-prio", vllm_log_dir,
                                core="1", extra_args=prio))
        p, d = procs
        wait_ready([p, d], "/health", ENGINE_START_TIMEOUT_S)
        proxies = Proxies([p.url, d.url])
        p_rec, d_rec = proxies.recorders
        keys = json.dumps([{"key": KEY, "name": "bulk", "priority": 3}])
        router = start_router(vllm_model_dir, [p_rec.url], [d_rec.url], vllm_log_dir,
                              ["--forward-priority", "--client-keys", keys,
                               "--api-keys", "sk-open-test-key"])
        procs.append(router)
        wait_ready([router], "/ready", 120.0)
        yield Rig(router.url, d, p_rec, d_rec)
    finally:
        if proxies is not None:
            proxies.close()
        for proc in reversed(procs):
            proc.stop()


def _body(stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}


def _colocated(d: Proc) -> str:
    """D's own answer to the prompt, with no P (greedy: the reference)."""
    resp = httpx.post(d.url + COMPLETIONS, json=_body(False), timeout=300,
                      headers={"Authorization": f"Bearer {ENGINE_KEY}"})
    return completion_text(resp, False)


@pytest.mark.parametrize("stream", [False, True])
def test_priority_reaches_both_legs_and_the_answer_is_right(rig: Rig, stream: bool) -> None:
    p_before, d_before = len(rig.p_rec.seen(COMPLETIONS)), len(rig.d_rec.seen(COMPLETIONS))
    resp = httpx.post(rig.router + COMPLETIONS, json=_body(stream, priority=5), timeout=300,
                      headers={"Authorization": "Bearer sk-open-test-key"})
    assert completion_text(resp, stream) == _colocated(rig.d)
    [p_leg] = rig.p_rec.seen(COMPLETIONS)[p_before:]
    [d_leg] = rig.d_rec.seen(COMPLETIONS)[d_before:]
    assert p_leg["kv_transfer_params"]["do_remote_decode"] is True  # P's leg
    assert "remote_block_ids" in d_leg["kv_transfer_params"]  # D's leg, with P's KV
    assert (p_leg["priority"], d_leg["priority"]) == (5, 5)


def test_a_mapped_key_bounds_the_priority_it_may_ask(rig: Rig) -> None:
    # The key's priority is 3: asking -4 (earlier) gets 3; its header asking 7 gets 7.
    auth = {"Authorization": f"Bearer {KEY}"}
    for body_extra, headers, sent in (({"priority": -4}, {}, 3),
                                      ({}, {"X-Request-Priority": "7"}, 7)):
        resp = httpx.post(rig.router + COMPLETIONS, json=_body(False, **body_extra),
                          headers={**auth, **headers}, timeout=300)
        assert completion_text(resp, False) == _colocated(rig.d)
        assert rig.p_rec.seen(COMPLETIONS)[-1]["priority"] == sent
        assert rig.d_rec.seen(COMPLETIONS)[-1]["priority"] == sent
