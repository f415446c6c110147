"""A thousand hostile requests against a router process leave no trace.

The router runs as its own process (`python -m pdgate.router`, client chat templates allowed with
a 0.5 s budget) in front of fake engines, so its RSS is not mixed with the test's. Mixed
attacks — nesting bombs, broken UTF-8 and surrogate escapes, prompts megabytes over the
context, thousands of messages, template loop and memory bombs, malformed JSON — must all
be answered with an OpenAI-style 4xx (429 when every template worker is busy), never a
5xx; `/health` must keep answering throughout; the router's RSS must end within 64 MiB of
where it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine
from tests.router.test_hostile_requests import refusal_cycles

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
TEMPLATE_BUDGET_S = 0.5
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextlib.asynccontextmanager
async def router_process(model_dir: Path, prefill: str, decode: str, log: Path
                         ) -> AsyncIterator[tuple[subprocess.Popen[bytes], httpx.AsyncClient]]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pdgate.router", "--model", str(model_dir),
           "--served-model-name", MODEL, "--prefill", prefill, "--decode", decode,
           "--port", str(port), "--health-interval-s", "3600", "--log-level", "warning",
           "--allow-client-chat-template", "--chat-template-timeout-s", str(TEMPLATE_BUDGET_S),
           # what is measured is the router's own tokenizing and template sandbox
           "--tokenize-prompts", "always"]
    # This checkout's router (and template workers), whatever is installed.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "router did not start"
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/health")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            yield proc, client
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _completion(prompt: bytes) -> bytes:
    return b'{"model": "tiny", "max_tokens": 4, "prompt": ' + prompt + b"}"


def _chat(content: bytes, extra: bytes = b"") -> bytes:
    return (b'{"model": "tiny", "max_tokens": 4, ' + extra + b'"messages": '
            b'[{"role": "user", "content": ' + content + b"}]}")


def _template(source: str) -> bytes:
    return _chat(b'"hi"', b'"chat_template": ' + json.dumps(source).encode() + b", ")


LOOP_BOMB = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
             "{% endfor %}")
MEMORY_BOMBS = [
    "{% set s = 'x' * 4000000 %}{% for i in range(1000) %}{{ s }}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set s = 'x' * 1000000 %}{{ [s] * 100000 }}",
    "{{ 'x' * 10000000000 }}",
    "{{ '%c' % 55296 }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
]
BAD_STRINGS = [b'"\xc0\xaf"', b'"\xed\xa0\x80"', b'"a\xed\xbf\xbfb"', b'"\xf4\x90\x80\x80"',
               b'"\xff"', b'"\xe2\x82"', b'"\\ud800"', b'"\\ud800x"', b'"\\udc00"']


def hostile_requests(rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    """`n` hostile (path, body) pairs, shuffled; big bodies are shared, not rebuilt."""
    big = "The quick brown fox " * 195_000  # 3.9 MB, under max_body_bytes
    huge = [
        (COMPLETIONS, json.dumps({"model": MODEL, "prompt": big}).encode()),
        (CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": big}]})
         .encode()),
        (COMPLETIONS, json.dumps({"model": MODEL, "prompt": big[:1_000_000]}).encode()),
        (COMPLETIONS, json.dumps({"model": MODEL, "prompt": list(range(500_000))}).encode()),
    ]
    many_messages = (CHAT, json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x"}] * 2049}).encode())
    wrappers: list[Callable[[bytes], bytes]] = [_completion, _chat]
    kinds: list[Callable[[], tuple[str, bytes]]] = [
        lambda: (rng.choice([COMPLETIONS, CHAT]), rng.choice(wrappers)(
            rng.choice([b"[", b'{"a": ']) * rng.randint(33, 100_000))),
        lambda: (rng.choice([COMPLETIONS, CHAT]),
                 b"[" * rng.randint(1000, 50_000) + b"]" * rng.randint(0, 50_000)),
        lambda: (COMPLETIONS, _completion(rng.choice(BAD_STRINGS))),
        lambda: (CHAT, _chat(rng.choice(BAD_STRINGS))),
        lambda: (CHAT, _chat(b'"x"', b'"tools": ' + b"[" * rng.randint(40, 5000) + b", ")),
        lambda: rng.choice(huge),
        lambda: many_messages,
        lambda: (CHAT, _template(rng.choice(MEMORY_BOMBS))),
        lambda: (CHAT, _chat(b'"hi"', b'"chat_template_kwargs": {"chat_template": '
                             + json.dumps(rng.choice(MEMORY_BOMBS)).encode() + b"}, ")),
        lambda: (rng.choice([COMPLETIONS, CHAT]), rng.choice([
            b"{not json", b'{"prompt": "x"', b"", b"[1, 2]", b'{"prompt": 1e999999}',
            b'{"model": "tiny", "prompt": {"a": 1}}', b'{"messages": "x"}'])),
    ]
    requests = [rng.choice(kinds)() for _ in range(n - 15)]
    requests += [(CHAT, _template(LOOP_BOMB))] * 15  # each holds a worker for the budget
    rng.shuffle(requests)
    return requests


def template_bombs(rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    """`n` template bombs only: loop bombs (each holds a worker for the whole budget) and
    memory bombs, in the body and in chat_template_kwargs."""
    return [(CHAT, _template(LOOP_BOMB)) if i % 2 else
            (CHAT, _chat(b'"hi"', b'"chat_template_kwargs": {"chat_template": '
                         + json.dumps(rng.choice(MEMORY_BOMBS)).encode() + b"}, "))
            for i in range(n)]


def _watch_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    # Its own thread and connection: the test's event loop, busy sending megabytes, does
    # not delay the probes; what is measured is the router's answer time.
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            resp = client.get("/health")
            latencies.append(time.perf_counter() - t0)
            assert resp.status_code == 200
            time.sleep(0.02)


@pytest.mark.timeout(600)
async def test_thousand_hostile_requests_no_5xx_health_responsive_rss_bounded(
    make_engine: MakeEngine, start_router: StartRouter, tiny_model_dir: Path, tmp_path: Path
) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    # Known cause of retained memory, tested on its own in test_hostile_requests.py.
    cycles = await refusal_cycles(await start_router([p], [d]))
    rng = random.Random(1234)
    mixed, bombs = hostile_requests(rng, 950), template_bombs(rng, 50)
    async with router_process(tiny_model_dir, p.url, d.url, tmp_path / "router.log") as (
            proc, client):
        # Warm-up: one served completion and chat (lazy imports, pools, first allocations).
        for path, body in [(COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                           (CHAT, {"model": MODEL, "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]})]:
            assert (await client.post(path, json=body)).status_code == 200
        rss_start = _rss(proc.pid)
        served = (len(p.requests), len(d.requests))

        statuses: Counter[int] = Counter()
        slots = asyncio.Semaphore(8)

        async def send(path: str, body: bytes) -> None:
            async with slots:
                resp = await client.post(path, content=body,
                                         headers={"Content-Type": "application/json"})
            statuses[resp.status_code] += 1
            assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert isinstance(err["message"], str) and err["message"] and err["type"]

        async def run(requests: list[tuple[str, bytes]]) -> tuple[float, float]:
            """(seconds taken, the longest /health answer meanwhile)."""
            stop, latencies = threading.Event(), [0.0]
            watcher = threading.Thread(target=_watch_health,
                                       args=(str(client.base_url), stop, latencies))
            watcher.start()
            t0 = time.perf_counter()
            try:
                await asyncio.gather(*(send(path, body) for path, body in requests))
            finally:
                stop.set()
                await asyncio.to_thread(watcher.join)
            return time.perf_counter() - t0, max(latencies)

        mixed_s, mixed_stall = await run(mixed)
        bombs_s, bombs_stall = await run(bombs)
        await asyncio.sleep(1.0)  # let the last buffers go
        rss_end = _rss(proc.pid)

    assert (len(p.requests), len(d.requests)) == served  # no hostile request got through
    report = (f"{sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}; "
              f"950 mixed in {mixed_s:.1f} s, /health max {mixed_stall * 1000:.0f} ms; 50 "
              f"template bombs in {bombs_s:.1f} s, /health max {bombs_stall * 1000:.0f} ms; "
              f"RSS {rss_start / MIB:.0f} -> {rss_end / MIB:.0f} MiB")
    print(report)
    assert sum(statuses.values()) == 1000
    # Template bombs never run on the event loop: /health answers well within the budget.
    assert bombs_stall < 2 * TEMPLATE_BUDGET_S, report
    # Megabyte bodies are decoded on the event loop (router/http/api.py): no freeze, though.
    assert mixed_stall < 5.0, report
    if rss_end - rss_start >= 64 * MIB and cycles:
        pytest.xfail(f"{report}; refused requests wait for a full GC ({', '.join(cycles)} in "
                     "a reference cycle): see test_refused_request_is_freed_without_waiting_"
                     "for_gc")
    assert rss_end - rss_start < 64 * MIB, report
