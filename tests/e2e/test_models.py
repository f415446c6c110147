"""Two models behind one router, end to end: two tiny models with different weights (seeds),
model `tiny` on P/D (pull, 1P1D), model `tiny-b` colocated (one decode engine), real shim
engines, real NIXL, the router from a `models:` config.

A recording relay sits in front of every engine, so the test sees what the router really
sent where: no request for one model reaches the other's engines. Every answer equals that
model's colocated greedy output (its own engine asked directly, no KV params), and the P/D
model's decode engine READ the prompt's KV over NIXL. `/v1/models` and `/ready?model=`
follow one pool going down (its engine frozen with SIGSTOP) and coming back.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdgate.engine_shim.tiny import TINY_SEED, ensure_tiny_model
from tests.chaos.cluster import Engine, stop_engines, wait_healthy
from tests.e2e.cluster import ROOT, complete, free_port_range, metric, start_cluster
from tests.e2e.relay import Relay, running_relays

pytestmark = pytest.mark.slow

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.",
           "Paged attention stores keys and values in fixed size blocks. " * 6]
KV_READ = "pdgate_shim_kv_transfer_bytes_total"


@dataclass
class Fleet:
    router: str
    proc: subprocess.Popen[bytes]
    engines: dict[str, Engine]  # a-prefill, a-decode, b-decode
    relays: dict[str, Relay]  # the same keys: the URL the router was given


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("models")
    other = ensure_tiny_model(tmp / "tiny-b", seed=TINY_SEED + 1)  # other weights
    plan = {"a-prefill": (tiny_model_dir, "tiny"), "a-decode": (tiny_model_dir, "tiny"),
            "b-decode": (other, "tiny-b")}
    base = free_port_range(2 * len(plan) + 1)
    engines = {}
    for i, (name, (model_dir, served)) in enumerate(plan.items()):
        port, side = base + 1 + i, base + 1 + len(plan) + i
        argv = [sys.executable, "-m", "pdgate.engine_shim", "--model", str(model_dir),
                "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
                "--block-size", "4", "--num-blocks", "256", "--engine-id", name,
                "--side-channel-host", "127.0.0.1", "--side-channel-port", str(side),
                "--log-level", "warning"]
        engines[name] = Engine(name, name.split("-")[1], port, side, argv, tmp / f"{name}.log")
    try:
        for e in engines.values():
            e.start()
        for e in engines.values():
            wait_healthy(e, 180)
        with running_relays(*(e.url for e in engines.values())) as relays:
            by_name = dict(zip(engines, relays, strict=True))
            proc, url = _start_router(tmp, base, by_name)
            try:
                yield Fleet(url, proc, engines, by_name)
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        stop_engines(list(engines.values()))


def _start_router(tmp: Path, port: int, relays: dict[str, Relay]
                  ) -> tuple[subprocess.Popen[bytes], str]:
    config = {"models": [
        {"model": "tiny", "prefill": [relays["a-prefill"].url],
         "decode": [relays["a-decode"].url]},
        {"model": "tiny-b", "decode": [relays["b-decode"].url], "pd_mode": "colocated"},
    ]}
    path = tmp / "router.yaml"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "pdgate.router", "--config", str(path), "--port", str(port),
            "--health-interval-s", "0.2", "--health-timeout-s", "0.5",
            "--health-failure-threshold", "1", "--log-level", "warning"]
    with (tmp / "router.log").open("ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    _wait_status(url + "/ready", 200, 60, proc)
    return proc, url


def _wait_status(url: str, status: int, timeout: float,
                 proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, "router exited"
        try:
            if httpx.get(url, timeout=2.0).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered {status}")


def _text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["text"])


def test_every_answer_is_its_models_colocated_greedy_output(fleet: Fleet) -> None:
    a_decode, b_decode = fleet.engines["a-decode"].url, fleet.engines["b-decode"].url
    read_before = metric(a_decode, KV_READ, "read")
    differ = 0
    for prompt in PROMPTS:
        via_a = httpx.post(fleet.router + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert via_a.status_code == 200, via_a.text
        assert via_a.headers["x-pdgate-prefill-engine"] == fleet.relays["a-prefill"].url
        assert via_a.headers["x-pdgate-decode-engine"] == fleet.relays["a-decode"].url
        via_b = complete(fleet.router, prompt, 12, model="tiny-b")
        # Colocated references: each model's own engine, asked directly without KV params.
        assert _text(via_a.json()) == _text(complete(a_decode, prompt, 12, model="tiny"))
        assert _text(via_b) == _text(complete(b_decode, prompt, 12, model="tiny-b"))
        differ += _text(via_a.json()) != _text(via_b)
    assert differ == len(PROMPTS)  # other weights, other answers: the models are distinct
    assert metric(a_decode, KV_READ, "read") > read_before  # A's KV moved P -> D over NIXL
    assert metric(b_decode, KV_READ, "read") == 0  # B computed its prompts itself


def test_no_request_for_one_model_reaches_the_others_engines(fleet: Fleet) -> None:
    complete(fleet.router, "Hello", 4, model="tiny")
    chat = httpx.post(fleet.router + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "stream": True})
    assert chat.status_code == 200 and "[DONE]" in chat.text
    seen = {name: [leg.body.get("model") for leg in relay.legs if leg.body is not None]
            for name, relay in fleet.relays.items()}
    assert seen["a-prefill"] and set(seen["a-prefill"]) == {"tiny"}
    assert seen["a-decode"] and set(seen["a-decode"]) == {"tiny"}
    assert seen["b-decode"] and set(seen["b-decode"]) == {"tiny-b"}
    # A's prefill legs ask P to keep the KV for D; the colocated model never has one.
    assert all(leg.body["kv_transfer_params"]["do_remote_decode"]
               for leg in fleet.relays["a-prefill"].completions())
    assert not any("kv_transfer_params" in leg.body
                   for leg in fleet.relays["b-decode"].completions())


def test_models_and_ready_follow_one_pool_going_down(fleet: Fleet) -> None:
    b = fleet.engines["b-decode"]
    b.signal(signal.SIGSTOP)  # frozen: its health probes time out
    try:
        _wait_status(fleet.router + "/ready", 503, 30)
        assert httpx.get(fleet.router + "/ready?model=tiny", timeout=5).status_code == 200
        one = httpx.get(fleet.router + "/ready?model=tiny-b", timeout=5)
        assert one.status_code == 503 and one.json()["models"]["tiny-b"]["ready"] is False
        cards = {c["id"]: c for c in httpx.get(fleet.router + "/v1/models",
                                               timeout=5).json()["data"]}
        assert cards["tiny"]["ready"] is True and cards["tiny-b"]["ready"] is False
        # `root` as the model's engines report it (the shim: the directory it loaded).
        own = httpx.get(fleet.engines["a-decode"].url + "/v1/models", timeout=5).json()
        assert cards["tiny"]["root"] == own["data"][0]["root"]
        assert cards["tiny"]["root"].endswith("/tiny") and cards["tiny"]["parent"] is None
        # The other model keeps serving; the one without engines is a clear 503.
        assert _text(complete(fleet.router, "Hello", 4, model="tiny"))
        down = httpx.post(fleet.router + "/v1/completions", timeout=30,
                          json={"model": "tiny-b", "prompt": "Hello", "max_tokens": 4})
        assert down.status_code == 503, down.text
    finally:
        b.signal(signal.SIGCONT)
    _wait_status(fleet.router + "/ready", 200, 30)
    assert httpx.get(fleet.router + "/ready?model=tiny-b", timeout=5).status_code == 200
    assert _text(complete(fleet.router, "Hello", 4, model="tiny-b"))


def test_pdgate_up_starts_several_models(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`pdgate up --models 2 --colocated-models 1`: the tiny model on 1P1D and a seeded
    copy colocated, behind one router; the demo asks each, and only the P/D one moves KV."""
    c = start_cluster(tmp_path, tiny_model_dir, demo=True, models=2, colocated_models=1)
    try:
        (pa, da), (pb, db) = c.per_model
        assert (len(pa), len(da), pb, len(db)) == (1, 1, [], 1)
        cards = httpx.get(c.router + "/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["ready"]) for m in cards] == [("tiny", True), ("tiny-2", True)]
        a = complete(c.router, "Hello", 8)
        b = complete(c.router, "Hello", 8, model="tiny-2")
        assert _text(a) == _text(complete(da[0], "Hello", 8))
        assert _text(b) == _text(complete(db[0], "Hello", 8, model="tiny-2"))
        assert _text(a) != _text(b)  # another seed, other weights
    finally:
        assert c.stop(signal.SIGINT) == 0
    out = c.console + (c.proc.stdout.read() if c.proc.stdout else "")
    moved = [line for line in out.splitlines() if line.startswith("KV bytes moved")]
    assert len(moved) == 2 and int(moved[0].split(":")[1].split()[0]) > 0, out
    assert "none (colocated" in moved[1], out
