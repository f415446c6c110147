"""Mid-stream migration on a real 1P2D cluster (shim engines, NIXL, router) on loopback, in
every P/D mode: `kill -9` a decode engine while 20 streams run, and every stream must
complete as if nothing happened.

The streams start staggered, so the victim's streams are cut at different token counts; the
kill itself fires when one of them has received `k` events (k per mode: early, mid-stream,
right before its last token). What each client must see: one stream with the colocated
greedy text exactly (the tiny model's vocabulary has byte tokens, so some cuts fall inside
a multi-byte character), one id, no SSE error event, one `[DONE]`, usage billed as one
request (the prompt's tokens, `max_tokens` completion tokens). The router counts the
migrations as `kv` (P's KV moved to the surviving decode engine), and that engine's
transfer log shows the continuation's blocks arriving over NIXL: more than the original
prompt's, since the prefix carries the generated tokens too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pdgate.engine_shim.tiny import TINY_MODEL_NAME
from tests.chaos.cluster import (
    ChaosCluster,
    Engine,
    paced,
    restart_down,
    start_engines,
    start_router,
    stop_engines,
    wait_healthy,
)
from tests.e2e.cluster import metric

pytestmark = pytest.mark.slow

N_STREAMS = 20
MAX_TOKENS = 64
BLOCK_SIZE = 4  # tests.chaos.cluster's engines
PROMPTS = [f"Stream {i} wants the tiny model to keep talking for a while." for i in
           range(N_STREAMS)]
# Every fourth stream is a chat completion: its continuation is a completion over the
# rendered template's ids, relayed as chat chunks.
CHAT = frozenset(PROMPTS[3::4])
# The victim's stream whose k-th event fires the kill, per mode: right before its last
# token (its colocated stream's events less the finishing and usage ones), after P's token
# and D's first, and mid-stream.
KILL_AT = {"pull": lambda events: events - 2, "notify": lambda events: 3,
           "push": lambda events: events // 2}
CLIENT_DEADLINE_S = 60.0


@dataclass
class Seen:
    """What one client saw."""

    prompt: str
    status: int = 0
    decode: str | None = None
    ids: set[str] = field(default_factory=set)
    objects: set[str] = field(default_factory=set)
    roles: int = 0
    text: str = ""
    events: int = 0
    errors: list[str] = field(default_factory=list)
    dones: int = 0
    usage: dict[str, int] | None = None
    lost: str | None = None
    rid: str | None = None  # X-Pdgate-Request-Id: the engines' id of the request


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[list[Engine], int]]:
    started, port = start_engines(tmp_path_factory.mktemp("migration"), tiny_model_dir,
                                  prefill=1, decode=2)
    try:
        yield started, port
    finally:
        stop_engines(started)


@pytest.fixture(scope="module")
def reference(engines: tuple[list[Engine], int]) -> dict[str, tuple[str, int, int]]:
    """Colocated greedy answers from a decode engine alone: text, prompt tokens, and the
    number of data events of its stream."""
    engine = next(e for e in engines[0] if e.role == "decode")
    out = {}
    for prompt in PROMPTS:
        seen = Seen(prompt)
        with httpx.stream("POST", engine.url + _path(prompt), timeout=60,
                          json=_body(prompt, stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    _event(seen, line[6:])
        assert seen.usage is not None and not seen.errors
        out[prompt] = seen.text, seen.usage["prompt_tokens"], seen.events
    return out


def _path(prompt: str) -> str:
    return "/v1/chat/completions" if prompt in CHAT else "/v1/completions"


def _body(prompt: str, *, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {"model": TINY_MODEL_NAME, "max_tokens": MAX_TOKENS,
                               "temperature": 0, "ignore_eos": True, "stream": stream}
    if prompt in CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _stream(client: httpx.AsyncClient, url: str, seen: Seen, victim: Engine,
                  kill_at: int, killed: list[Seen]) -> None:
    """One client's stream; the kill fires when it is the victim's (a prefill victim:
    any stream) and has had `kill_at` events."""
    try:
        async with asyncio.timeout(CLIENT_DEADLINE_S), client.stream(
                "POST", url + _path(seen.prompt), json=_body(seen.prompt, stream=True)) as r:
            seen.status = r.status_code
            seen.decode = r.headers.get("x-pdgate-decode-engine")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    _event(seen, line[6:])
                    mine = victim.role == "prefill" or seen.decode == victim.url
                    if mine and seen.events == kill_at and not killed:
                        killed.append(seen)
                        victim.kill()
    except (TimeoutError, httpx.HTTPError) as exc:
        seen.lost = repr(exc)


def _event(seen: Seen, data: str) -> None:
    if data == "[DONE]":
        seen.dones += 1
        return
    seen.events += 1
    obj = json.loads(data)
    if "error" in obj:
        seen.errors.append(obj["error"].get("message", ""))
        return
    seen.ids.add(obj["id"])
    seen.objects.add(obj["object"])
    for choice in obj["choices"]:
        assert "token_ids" not in choice, "token ids leaked to a client that did not ask"
        if "delta" in choice:
            seen.text += choice["delta"].get("content") or ""
            seen.roles += "role" in choice["delta"]
        else:
            seen.text += choice.get("text", "")
    if obj.get("usage"):
        seen.usage = obj["usage"]


async def _run(url: str, victim: Engine, kill_at: dict[str, int]
               ) -> tuple[list[Seen], list[Seen]]:
    seen = [Seen(p) for p in PROMPTS]
    killed: list[Seen] = []
    limits = httpx.Limits(max_connections=N_STREAMS, max_keepalive_connections=N_STREAMS)
    async with httpx.AsyncClient(timeout=CLIENT_DEADLINE_S, limits=limits) as client:
        tasks = []
        for s in seen:
            tasks.append(asyncio.create_task(_stream(client, url, s, victim, kill_at[s.prompt],
                                                      killed)))
            await asyncio.sleep(0.01)  # staggered: the victim's streams are cut at many k
        await asyncio.gather(*tasks)
    return seen, killed


@pytest.mark.parametrize("mode", ["pull", "notify", "push"])
def test_decode_killed_mid_stream_every_stream_completes(
        mode: str, engines: tuple[list[Engine], int], tiny_model_dir: Path,
        reference: dict[str, tuple[str, int, int]]) -> None:
    started, port = engines
    restart_down(started)
    cluster = start_router(started, port, tiny_model_dir, mode)
    try:
        _scenario(cluster, reference, mode)
    finally:
        cluster.stop()


@pytest.mark.parametrize("mode", ["pull", "notify", "push"])
def test_prefill_killed_after_the_first_token(
        mode: str, engines: tuple[list[Engine], int], tiny_model_dir: Path,
        reference: dict[str, tuple[str, int, int]]) -> None:
    started, port = engines
    restart_down(started)
    cluster = start_router(started, port, tiny_model_dir, mode)
    victim = cluster.by_role("prefill")[0]
    try:
        seen, killed = asyncio.run(_run(cluster.url, victim, dict.fromkeys(reference, 1)))
        assert killed, "the kill did not fire"
        print(f"\nMIGRATION mode={mode} prefill killed after a first event: "
              f"{sum(s.errors == [] for s in seen)}/{len(seen)} streams without error")
        _assert_all_complete(seen, reference)
    finally:
        cluster.stop()
        victim.start()
        wait_healthy(victim, 120)


def _assert_all_complete(seen: list[Seen], reference: dict[str, tuple[str, int, int]]
                         ) -> None:
    """Every stream as an uninterrupted one: the colocated text, one id, no error event,
    one [DONE], chat chunks for chat, usage billed as one request."""
    for s in seen:
        want, prompt_tokens, _ = reference[s.prompt]
        where = f"{s.prompt!r} (decode {s.decode})"
        assert s.lost is None, f"{where}: lost: {s.lost}"
        assert s.status == 200, where
        assert s.errors == [], f"{where}: SSE error event {s.errors}"
        assert s.dones == 1, f"{where}: {s.dones} [DONE]"
        assert len(s.ids) == 1, f"{where}: chunk ids {s.ids}"
        chat = s.prompt in CHAT
        assert s.objects == {"chat.completion.chunk" if chat else "text_completion"}, where
        assert s.roles == (1 if chat else 0), f"{where}: {s.roles} role deltas"
        assert s.text == want, f"{where}: text {s.text!r}, want {want!r}"
        assert s.usage is not None and {k: s.usage[k] for k in (
            "prompt_tokens", "completion_tokens", "total_tokens")} == {
            "prompt_tokens": prompt_tokens, "completion_tokens": MAX_TOKENS,
            "total_tokens": prompt_tokens + MAX_TOKENS}, f"{where}: usage {s.usage}"


def _scenario(cluster: ChaosCluster, reference: dict[str, tuple[str, int, int]], mode: str
              ) -> None:
    victim, survivor = cluster.by_role("decode")
    t0 = time.monotonic()
    kill_at = {p: KILL_AT[mode](events) for p, (_, _, events) in reference.items()}
    with paced(victim):
        seen, killed = asyncio.run(_run(cluster.url, victim, kill_at))
    took = time.monotonic() - t0
    assert killed, "no stream was served by the victim"
    cut = [s for s in seen if s.decode == victim.url]
    kv = metric(cluster.url, "pdgate_migrations_total", f'mode="{mode}",result="kv"')
    failed = metric(cluster.url, "pdgate_migrations_total", f'mode="{mode}",result="failed"')
    print(f"\nMIGRATION mode={mode} streams={len(seen)} on_victim={len(cut)} "
          f"kill_at={kill_at[killed[0].prompt]} migrations_kv={kv} failed_opens={failed} "
          f"took={took:.1f}s")
    _assert_all_complete(seen, reference)
    # Every stream the kill cut was continued with P's KV (the victim's streams that had
    # already finished need none).
    assert kv >= 1, "no migration was counted"
    _assert_prefix_over_nixl(survivor, reference)
    victim.start()
    wait_healthy(victim, 120)


def _assert_prefix_over_nixl(survivor: Engine, reference: dict[str, tuple[str, int, int]],
                             prompts: Mapping[str, int] | None = None) -> None:
    """The surviving decode engine's transfer log has the continuations' blocks (engine
    request ids `<id>-m1...`), covering more than any original prompt; with `prompts`
    (engine request id: prompt tokens), more than the prompt of the request continued."""
    log = httpx.get(survivor.url + "/debug/kv_transfers", timeout=10).json()["transfers"]
    moved = [e for e in log if "-m1" in e["request_id"]]
    if prompts is not None:
        moved = [e for e in moved if e["request_id"].split("-m1")[0] in prompts]
    assert moved, f"no continuation's KV reached {survivor.name}: {log[-5:]}"
    if prompts is None:
        longest_prompt = max(n for _, n, _ in reference.values())
        covered = max(e["blocks"] for e in moved) * BLOCK_SIZE
        assert covered > longest_prompt + BLOCK_SIZE, (covered, longest_prompt, moved[:3])
        return
    beyond = max(e["blocks"] * BLOCK_SIZE - prompts[e["request_id"].split("-m1")[0]]
                 for e in moved)
    assert beyond > BLOCK_SIZE, (beyond, moved[:3])


# Non-streaming requests (`--migrate-non-streaming`): the router runs their decode leg as a
# stream it reads itself, so a decode engine killed mid-generation is continued the same
# way, and the client, who saw nothing before the answer, gets one whole answer. The kill
# fires when the victim has generated this many tokens (over all its requests, about half
# of the 20, which run together: a tenth of it each) since the burst began.
NONSTREAM_KILL_AFTER = {"pull": 100, "notify": 250, "push": 400}


async def _answer(client: httpx.AsyncClient, url: str, seen: Seen) -> None:
    """One non-streaming request; what its client got."""
    try:
        r = await client.post(url + _path(seen.prompt), json=_body(seen.prompt, stream=False))
    except (TimeoutError, httpx.HTTPError) as exc:
        seen.lost = repr(exc)
        return
    seen.status = r.status_code
    seen.decode = r.headers.get("x-pdgate-decode-engine")
    seen.rid = r.headers.get("x-pdgate-request-id")
    obj = r.json()
    if "error" in obj:
        seen.errors.append(obj["error"].get("message", ""))
        return
    seen.ids.add(obj["id"])
    seen.objects.add(obj["object"])
    for choice in obj["choices"]:
        seen.text += choice["message"]["content"] if "message" in choice else choice["text"]
        seen.roles += choice.get("message", {}).get("role") == "assistant"
        assert "token_ids" not in choice, "token ids leaked to a client that did not ask"
    seen.usage = obj.get("usage")


async def _kill_after(victim: Engine, tokens: int, killed: list[float]) -> None:
    """`kill -9` the victim once it generated `tokens` more tokens; the count it had then."""
    name = "pdgate_shim_generation_tokens_total"
    base = await asyncio.to_thread(metric, victim.url, name)
    while True:
        now = await asyncio.to_thread(metric, victim.url, name)
        if now - base >= tokens:
            victim.kill()
            killed.append(now - base)
            return
        await asyncio.sleep(0.01)


async def _run_answers(url: str, victim: Engine, tokens: int) -> tuple[list[Seen], float]:
    seen = [Seen(p) for p in PROMPTS]
    killed: list[float] = []
    limits = httpx.Limits(max_connections=N_STREAMS, max_keepalive_connections=N_STREAMS)
    async with httpx.AsyncClient(timeout=CLIENT_DEADLINE_S, limits=limits) as client:
        killer = asyncio.create_task(_kill_after(victim, tokens, killed))
        await asyncio.gather(*(_answer(client, url, s) for s in seen))
        killer.cancel()
    assert killed, f"the victim never generated {tokens} tokens"
    return seen, killed[0]


@pytest.mark.parametrize("mode", ["pull", "notify", "push"])
def test_decode_killed_mid_generation_of_non_streaming_requests(
        mode: str, engines: tuple[list[Engine], int], tiny_model_dir: Path,
        reference: dict[str, tuple[str, int, int]]) -> None:
    """Every non-streaming request the kill cut gets a 200 with the colocated greedy text
    and usage billed as one request, continued with P's KV on the surviving engine."""
    started, port = engines
    restart_down(started)
    cluster = start_router(started, port, tiny_model_dir, mode,
                           extra=["--migrate-non-streaming"])
    victim, survivor = cluster.by_role("decode")
    try:
        t0 = time.monotonic()
        with paced(victim):
            seen, at = asyncio.run(_run_answers(cluster.url, victim,
                                                NONSTREAM_KILL_AFTER[mode]))
        took = time.monotonic() - t0
        kv = metric(cluster.url, "pdgate_migrations_total", f'mode="{mode}",result="kv"')
        retries = metric(cluster.url, "pdgate_retries_total", 'role="decode"')
        redone = metric(cluster.url, "pdgate_fallbacks_total", 'reason="decode_retry"')
        print(f"\nMIGRATION non-streaming mode={mode} requests={len(seen)} killed after "
              f"{at:.0f} victim tokens, migrations_kv={kv} decode_retries={retries} "
              f"decode_retry_recomputes={redone} took={took:.1f}s")
        for s in seen:
            want, prompt_tokens, _ = reference[s.prompt]
            where = f"{s.prompt!r} (decode {s.decode})"
            assert s.lost is None and s.status == 200, f"{where}: {s.lost or s.status} {s.errors}"
            chat = s.prompt in CHAT
            assert s.objects == {"chat.completion" if chat else "text_completion"}, where
            assert s.roles == (1 if chat else 0), where
            assert s.text == want, f"{where}: text {s.text!r}, want {want!r}"
            assert s.usage is not None and {k: s.usage.get(k) for k in (
                "prompt_tokens", "completion_tokens", "total_tokens")} == {
                "prompt_tokens": prompt_tokens, "completion_tokens": MAX_TOKENS,
                "total_tokens": prompt_tokens + MAX_TOKENS}, f"{where}: usage {s.usage}"
        assert kv >= 1, "no migration was counted"
        _assert_prefix_over_nixl(survivor, reference, {
            s.rid: reference[s.prompt][1] for s in seen if s.rid})
    finally:
        cluster.stop()
        if not victim.running:
            victim.start()
            wait_healthy(victim, 120)
