"""Notify and push modes end to end: `pdgate up --pd-mode notify|push`, real shim engines,
real NIXL WRITEs, the router's KV-ready proxy. Disaggregated greedy output must equal
colocated output token for token, the KV bytes D received must equal P's, and every block
pool must come back full, also after abandoned streams and failed requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import (
    Cluster,
    burst,
    child_pids,
    complete,
    metric,
    start_cluster,
    wait_pools_full,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed size blocks. " * 12,
]
BLOCK_BYTES = 4 * 2 * 16 * 4  # tiny model, block size 4, float32: one block of one K or V
LAYERS = 2


@pytest.fixture(scope="module", params=["notify", "push"])
def cluster(request: pytest.FixtureRequest, tiny_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    mode = request.param
    c = start_cluster(tmp_path_factory.mktemp(mode), tiny_model_dir,
                      extra=["--pd-mode", mode])
    c.mode = mode  # type: ignore[attr-defined]
    yield c
    c.stop()


def _write_bytes(c: Cluster) -> float:
    return metric(c.prefill[0], "pdgate_shim_kv_transfer_bytes_total", 'op="write"')


@pytest.mark.parametrize("prompt", PROMPTS, ids=["1-block", "3-blocks", "many-blocks"])
def test_greedy_output_equals_colocated(cluster: Cluster, prompt: str) -> None:
    before = _write_bytes(cluster)
    via_router = complete(cluster.router, prompt)
    written = _write_bytes(cluster) - before
    colocated = complete(cluster.decode[0], prompt)
    assert via_router["choices"][0]["text"] == colocated["choices"][0]["text"]
    assert via_router["usage"]["prompt_tokens"] == colocated["usage"]["prompt_tokens"]
    n_blocks = -(-colocated["usage"]["prompt_tokens"] // 4)
    assert written == n_blocks * LAYERS * 2 * BLOCK_BYTES  # P wrote exactly the prompt


def _stream(url: str, prompt: str, max_tokens: int = 24, **extra: object
            ) -> tuple[str, dict[str, int]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    text, usage = "", {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                text += "".join(c["text"] for c in event["choices"])
    return text, usage


# "Hello world" starts with half a character: P's token carries no text of its own.
@pytest.mark.parametrize("prompt", [*PROMPTS, "Hello world"],
                         ids=["1-block", "3-blocks", "many-blocks", "split-char"])
def test_streamed_greedy_output_equals_colocated(cluster: Cluster, prompt: str) -> None:
    early = 'result="kv"'
    before = metric(cluster.router, "pdgate_early_first_tokens_total", early)
    streamed, usage = _stream(cluster.router, prompt)
    colocated = complete(cluster.decode[0], prompt)
    assert streamed == colocated["choices"][0]["text"]
    assert usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == colocated["usage"]["prompt_tokens"]
    # P's token went out first and D continued after it (with P's KV).
    assert metric(cluster.router, "pdgate_early_first_tokens_total", early) == before + 1


def test_sampled_stream_keeps_its_token_budget(cluster: Cluster) -> None:
    text, usage = _stream(cluster.router, PROMPTS[2], max_tokens=12, temperature=1.0)
    assert usage["completion_tokens"] == 12 and text


def test_push_continuation_without_p_token_fails_instead_of_resampling(
        cluster: Cluster) -> None:
    """A push decode leg told to continue after P's token must not invent that token: when
    the push cannot land (here: the router aborts it), its stream is one error event."""
    if cluster.mode != "push":  # type: ignore[attr-defined]
        pytest.skip("push mode only")
    info = httpx.get(cluster.prefill[0] + "/v1/kv/info", timeout=5).json()
    rid = f"orphan-{time.monotonic_ns()}"
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4, "stream": True,
            "kv_transfer_params": {
                "do_remote_prefill": True, "pdgate_mode": "push",
                "continue_after_prefill": True, "remote_engine_id": info["engine_id"],
                "remote_host": info["host"], "remote_port": info["port"]}}

    async def run() -> str:
        async with httpx.AsyncClient(timeout=60) as client:
            async def stream() -> str:
                r = await client.post(cluster.decode[0] + "/v1/completions", json=body,
                                      headers={"X-Request-Id": rid})
                return r.text
            task = asyncio.create_task(stream())
            await asyncio.sleep(1.0)  # D registered with P, which never prefills this id
            await client.post(cluster.decode[0] + "/v1/kv/abort", json={"request_id": rid})
            return await task

    text = asyncio.run(run())
    events = [line for line in text.split("\n") if line.startswith("data: ")]
    assert len(events) == 2 and events[1] == "data: [DONE]", text
    assert "no token from the prefill engine" in json.loads(events[0][6:])["error"]["message"]
    wait_pools_full(cluster)


def test_decode_received_exactly_the_prefill_bytes(cluster: Cluster) -> None:
    rid = f"digest-{cluster.mode}-{time.monotonic_ns()}"  # type: ignore[attr-defined]
    resp = httpx.post(cluster.router + "/v1/completions", headers={"X-Request-Id": rid},
                      json={"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 4},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Request-Id"] == rid
    rid = resp.headers["X-Pdgate-Request-Id"]  # engines know the request by the router's id
    held = httpx.get(cluster.prefill[0] + "/debug/kv_transfers", timeout=5).json()
    got = httpx.get(cluster.decode[0] + "/debug/kv_transfers", timeout=5).json()
    p = next(t for t in held["transfers"] if t["request_id"] == rid)
    d = next(t for t in got["transfers"] if t["request_id"] == rid)
    assert p["role"] == "prefill"
    assert d["role"] == f"decode-{cluster.mode}"  # type: ignore[attr-defined]
    assert d["bytes"] == p["bytes"] > 0 and p["digest"] and p["digest"] == d["digest"]


def test_chat_stream_equals_non_stream_and_bills_the_prompt(cluster: Cluster) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(cluster.router + "/v1/chat/completions", json=body, timeout=60).json()
    text, usage = "", None
    with httpx.stream("POST", cluster.router + "/v1/chat/completions", timeout=60,
                      json={**body, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                text += choice["delta"].get("content") or ""
    assert text == whole["choices"][0]["message"]["content"]
    assert usage is not None and usage["completion_tokens"] == 6
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"] > 0


def test_block_pools_return_to_full_after_burst(cluster: Cluster) -> None:
    asyncio.run(burst(cluster, PROMPTS, full=10, abandoned=6, first_max_tokens=8,
                      extra={"temperature": 0}))
    wait_pools_full(cluster)
    assert metric(cluster.router, "pdgate_fallbacks_total") == 0
    if cluster.mode == "notify":  # type: ignore[attr-defined]
        assert metric(cluster.router, "pdgate_proxy_messages_total",
                      'result="ok"') >= 10
        assert metric(cluster.router, "pdgate_proxy_waiters") == 0
        assert metric(cluster.router, "pdgate_kv_wait_seconds_count") >= 10


# ---- failures ------------------------------------------------------------------------------

def _engine_pid(c: Cluster, name: str) -> int:
    for pid in child_pids(c.proc.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--engine-id" in cmdline and cmdline[cmdline.index(b"--engine-id") + 1] == \
                name.encode():
            return pid
    raise AssertionError(f"no process for {name}")


@pytest.fixture
def notify_cluster(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, tiny_model_dir, extra=[
        "--pd-mode", "notify", "--router-arg=--kv-ready-timeout-s=3"])
    yield c
    for pid in child_pids(c.proc.pid):  # a test may leave P stopped
        os.kill(pid, signal.SIGCONT)
    c.stop()


def test_notify_without_kv_ready_fails_by_the_deadline_and_leaks_nothing(
        notify_cluster: Cluster) -> None:
    c = notify_cluster
    p_pid = _engine_pid(c, "prefill-0")
    os.kill(p_pid, signal.SIGSTOP)  # P takes the request but never pushes nor notifies
    try:
        t0 = time.monotonic()
        r = httpx.post(c.router + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4})
        waited = time.monotonic() - t0
    finally:
        os.kill(p_pid, signal.SIGCONT)
    assert r.status_code == 504, r.text
    assert "KV-ready" in r.json()["error"]["message"]
    assert 2.5 < waited < 10
    # P wakes up after the deadline: it must not write into D's released blocks.
    wait_pools_full(c)
    assert metric(c.prefill[0], "pdgate_shim_kv_transfer_bytes_total", 'op="write"') == 0
    assert metric(c.router, "pdgate_proxy_waiters") == 0
    ok = complete(c.router, PROMPTS[0], max_tokens=4)  # and the cluster still serves
    assert ok["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("mode", ["notify", "push"])
def test_prefill_engine_dying_mid_request_runs_on_decode_alone(
        tiny_model_dir: Path, tmp_path: Path, mode: str) -> None:
    """P killed while it holds a request's leg: its dropped connection ends the wait at
    once (not the KV-ready deadline), and, P being the only prefill engine and still
    counted healthy until its next probe, the request runs on D alone (as in pull mode)
    instead of failing."""
    c = start_cluster(tmp_path, tiny_model_dir, extra=[
        "--pd-mode", mode, "--router-arg=--kv-ready-timeout-s=20"])
    try:
        p_pid = _engine_pid(c, "prefill-0")
        os.kill(p_pid, signal.SIGSTOP)

        async def request() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as client:
                return await client.post(c.router + "/v1/completions", json={
                    "model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4})

        async def run() -> tuple[httpx.Response, float]:
            task = asyncio.create_task(request())
            await asyncio.sleep(1.0)  # the legs are out; P is frozen
            t0 = time.monotonic()
            os.kill(p_pid, signal.SIGKILL)
            resp = await task
            return resp, time.monotonic() - t0

        resp, waited = asyncio.run(run())
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        # D computed the prompt, counted in the access line. (Not read from /metrics:
        # `pdgate up` stops the whole cluster once it sees an engine exit, maybe already.)
        assert "x-pdgate-prefill-engine" not in resp.headers
        rid = resp.headers["x-request-id"]
        deadline, lines = time.monotonic() + 10, []  # the line may follow the last byte
        while not lines and time.monotonic() < deadline:
            lines = [line for line in (c.log_dir / "router.log").read_text().splitlines()
                     if f"request_id={rid}" in line and "pdgate.router.access" in line]
            time.sleep(0.05)
        assert lines and "mode=direct fallback=no_prefill" in lines[0], lines
        assert waited < 5  # P's dropped connection ends the wait, not the deadline
    finally:
        c.stop()
