"""Fault injection on a real 2P2D cluster (shim engines, NIXL, router) on loopback, in every
P/D mode the router has (`--pd-mode pull|notify|push`).

Each scenario breaks one engine while requests are in flight and checks what a user sees:
every request ends within its deadline (no hang) with the fault-free answer (greedy output
equal to the engine's own colocated answer) or a clear error (a 4xx/5xx with an OpenAI error
body, or an SSE error event after a correct prefix, then `[DONE]`); nothing is lost; no
non-streaming request fails while a healthy P/D pair remains (every mode fails over to other
engines before the client's first byte), and no stream does either (a decode engine's death
after the first byte is migrated: router/flows/migration.py); and after the fault every
surviving engine's KV block pool is entirely free again. The broken engine is then
restarted on the same ports (a new NIXL agent) and must serve again.

Scenarios: kill -9 a prefill engine under load; kill -9 a decode engine mid-stream; SIGSTOP
a prefill engine, then SIGCONT; and (notify mode only) KV-ready notices dropped: one prefill
engine restarted with a notify secret the router does not share, so the router's KV-ready
proxy drops every notice it sends (counted as `bad_mac`) although its prefills and WRITEs
succeed.

One set of engines serves all modes; each mode gets its own router (module-scoped fixtures).
Run with `-s` to see what the clients saw, one `CHAOS` line per scenario.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdgate.engine_shim.tiny import TINY_MODEL_NAME
from tests.chaos.cluster import (
    KV_READY_TIMEOUT_S,
    LEASE_S,
    ChaosCluster,
    Engine,
    pools_full,
    restart_down,
    start_engines,
    start_router,
    stop_engines,
    wait_healthy,
    wait_router_pairs,
)
from tests.e2e.cluster import metric

pytestmark = pytest.mark.slow

MODES = ["pull", "notify", "push"]
PROMPTS = [f"Request number {i} asks the tiny model something." for i in range(8)]
SHORT, LONG = 8, 96  # max_tokens: most requests / the streams a decode engine dies under
CLIENT_DEADLINE_S = 30.0  # every request must end well within this
POOL_WAIT_S = 4 * LEASE_S  # what a pinned block may take to come back (lease, abort grace)
# Signs KV-ready notices that the router cannot verify (it has tests.chaos.cluster's secret).
WRONG_SECRET = "rotated-elsewhere-0123456789abcdef"


@dataclass
class Outcome:
    """What one client saw."""

    prompt: str
    stream: bool
    max_tokens: int
    status: int = 0
    prefill: str | None = None
    decode: str | None = None
    text: str = ""
    error: str | None = None  # a clean error: the OpenAI error body's or SSE event's message
    lost: str | None = None  # why this request counts as lost (hang, garbage, wrong answer)
    events: int = 0  # SSE data events received
    seconds: float = 0.0


Spec = tuple[str, bool, int]  # prompt, stream, max_tokens
Reference = dict[tuple[str, int], str]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[list[Engine], int]]:
    started, router_port = start_engines(tmp_path_factory.mktemp("chaos"), tiny_model_dir)
    try:
        yield started, router_port
    finally:
        stop_engines(started)


@pytest.fixture(scope="module", params=MODES)
def cluster(request: pytest.FixtureRequest, engines: tuple[list[Engine], int],
            tiny_model_dir: Path) -> Iterator[ChaosCluster]:
    started, router_port = engines
    restart_down(started)  # a previous mode may have left one down
    c = start_router(started, router_port, tiny_model_dir, request.param)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def all_engines_up(cluster: ChaosCluster) -> None:
    cluster.revive()


@pytest.fixture(scope="module")
def reference(engines: tuple[list[Engine], int]) -> Reference:
    """Fault-free greedy answers: a decode engine's own colocated output, per prompt and
    max_tokens (disaggregated output must equal it in every mode)."""
    engine = next(e for e in engines[0] if e.role == "decode")
    out = {}
    for prompt in PROMPTS:
        for max_tokens in (SHORT, LONG):
            r = httpx.post(engine.url + "/v1/completions", timeout=60,
                           json=_body(prompt, False, max_tokens))
            assert r.status_code == 200, r.text
            out[prompt, max_tokens] = r.json()["choices"][0]["text"]
    return out


def _body(prompt: str, stream: bool, max_tokens: int) -> dict[str, object]:
    return {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def _one(client: httpx.AsyncClient, url: str, spec: Spec, want: str,
               on_event: Callable[[Outcome], None] | None) -> Outcome:
    prompt, stream, max_tokens = spec
    out = Outcome(prompt, stream, max_tokens)
    t0 = time.monotonic()
    raw = b""
    try:
        async with asyncio.timeout(CLIENT_DEADLINE_S):
            async with client.stream("POST", url + "/v1/completions",
                                     json=_body(prompt, stream, max_tokens)) as resp:
                out.status = resp.status_code
                out.prefill = resp.headers.get("x-pdgate-prefill-engine")
                out.decode = resp.headers.get("x-pdgate-decode-engine")
                if stream and resp.status_code == 200:
                    async for line in resp.aiter_lines():
                        raw += line.encode() + b"\n"
                        if line.startswith("data: "):
                            out.events += 1
                            if on_event is not None:
                                on_event(out)
                else:
                    raw = await resp.aread()
    except TimeoutError:
        out.lost = f"no answer within {CLIENT_DEADLINE_S}s"
    except httpx.HTTPError as exc:
        out.lost = f"transport error: {exc!r}"
    out.seconds = time.monotonic() - t0
    if out.lost is None:
        _judge(out, raw, want)
    return out


def _judge(out: Outcome, raw: bytes, want: str) -> None:
    """Classify a finished request: ok, clean error, or lost (with the reason)."""
    if out.status != 200:
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if 400 <= out.status < 600 and isinstance(message, str) and message:
            out.error = message
        else:
            out.lost = f"HTTP {out.status} without an OpenAI error body: {raw[:200]!r}"
        return
    if not out.stream:
        try:
            out.text = json.loads(raw)["choices"][0]["text"]
        except (ValueError, KeyError, TypeError, IndexError):
            out.lost = f"unreadable 200 body: {raw[:200]!r}"
            return
        if out.text != want:
            out.lost = f"wrong answer {out.text!r}, want {want!r}"
        return
    events = [line[6:] for line in raw.decode(errors="replace").splitlines()
              if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        out.lost = f"stream did not end with [DONE]: {raw[-200:]!r}"
        return
    for event in events[:-1]:
        try:
            obj = json.loads(event)
        except ValueError:
            out.lost = f"garbage event {event[:200]!r}"
            return
        if out.error is not None:
            out.lost = f"event after the error event: {event[:200]!r}"
            return
        if "error" in obj:
            out.error = str(obj["error"].get("message") or "") or "(empty message)"
        else:
            out.text += "".join(c.get("text", "") for c in obj.get("choices", []))
    if out.error is not None:
        if not want.startswith(out.text):
            out.lost = f"text before the error is not the answer's start: {out.text!r}"
    elif out.text != want:
        out.lost = f"wrong answer {out.text!r}, want {want!r}"


def _mix(n: int, *, stream_every: int = 0, max_tokens: int = SHORT,
         offset: int = 0) -> list[Spec]:
    """`n` requests over the prompts; every `stream_every`-th one streams."""
    return [(PROMPTS[(i + offset) % len(PROMPTS)],
             stream_every > 0 and i % stream_every == stream_every - 1, max_tokens)
            for i in range(n)]


async def _load(cluster: ChaosCluster, reference: Reference, specs: list[Spec],
                concurrency: int, *, fault: Callable[[], Awaitable[None]] | None = None,
                on_event: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """`specs`, `concurrency` at a time; `fault()` runs once a quarter of them are done."""
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def run(client: httpx.AsyncClient, spec: Spec) -> Outcome:
        nonlocal done
        async with sem:
            out = await _one(client, cluster.url, spec, reference[spec[0], spec[2]], on_event)
        done += 1
        return out

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=CLIENT_DEADLINE_S, limits=limits) as client:
        tasks = [asyncio.create_task(run(client, spec)) for spec in specs]
        if fault is not None:
            while done < len(specs) // 4:
                await asyncio.sleep(0.01)
            await fault()
        return list(await asyncio.gather(*tasks))


def _tally(outs: list[Outcome]) -> str:
    parts = []
    for name, group in (("plain", [o for o in outs if not o.stream]),
                        ("stream", [o for o in outs if o.stream])):
        if group:
            ok = sum(1 for o in group if o.lost is None and o.error is None)
            err = sum(1 for o in group if o.lost is None and o.error is not None)
            lost = sum(1 for o in group if o.lost is not None)
            slowest = max(o.seconds for o in group)
            parts.append(f"{name} ok={ok} err={err} lost={lost} max={slowest:.2f}s")
    return " | ".join(parts)


def _report(cluster: ChaosCluster, scenario: str, outs: list[Outcome], **notes: object
            ) -> None:
    extra = " ".join(f"{k}={v}" for k, v in notes.items())
    print(f"\nCHAOS mode={cluster.mode} {scenario}: {_tally(outs)} {extra}")
    errors: dict[str, int] = {}
    for o in outs:
        if o.error is not None or o.lost is not None:
            kind = "stream" if o.stream else "plain"
            what = f"lost: {o.lost}" if o.lost else f"{o.status} {o.error}"
            key = f"{kind} {what[:160]}"
            errors[key] = errors.get(key, 0) + 1
    for key, n in errors.items():
        print(f"CHAOS   {n} x {key}")


def _check(outs: list[Outcome], n: int, *,
           may_fail: Callable[[Outcome], bool] = lambda o: o.stream) -> None:
    """Nothing lost; an error only where `may_fail` allows one (by default: streams, which
    may end with an error event; a non-streaming request must succeed)."""
    assert len(outs) == n
    lost = [o for o in outs if o.lost is not None]
    assert not lost, f"{len(lost)} lost: {lost[:3]}"
    assert all(o.seconds < CLIENT_DEADLINE_S for o in outs)
    failed = [o for o in outs if o.error is not None and not may_fail(o)]
    assert not failed, f"{len(failed)} failed: {failed[:3]}"


def _retries(cluster: ChaosCluster) -> tuple[float, float]:
    return (metric(cluster.url, "pdgate_retries_total", 'role="prefill"'),
            metric(cluster.url, "pdgate_retries_total", 'role="decode"'))


def _assert_pools_full(engines: list[Engine]) -> float:
    """Every pool of `engines` entirely free (within POOL_WAIT_S); returns the wait."""
    t0 = time.monotonic()
    states = pools_full(engines, POOL_WAIT_S)
    assert all(f == t and leased == 0 for f, t, leased in states), \
        dict(zip([e.name for e in engines], states, strict=True))
    return time.monotonic() - t0


def _restart_and_check(cluster: ChaosCluster, engine: Engine, reference: Reference,
                       scenario: str, *, started: bool = False) -> None:
    """Bring `engine` back on its ports (new process, new NIXL agent; `started`: the test
    did already); the router must take it back, answers must stay right, and every pool must
    come back to full."""
    if not started:
        engine.restart()
    wait_healthy(engine, 120)
    wait_router_pairs(cluster, 2, 2)
    outs = asyncio.run(_load(cluster, reference, _mix(16, stream_every=4), 4))
    _report(cluster, f"{scenario}/after-restart", outs)
    _check(outs, 16, may_fail=lambda o: False)
    served = {o.prefill if engine.role == "prefill" else o.decode for o in outs}
    assert engine.url in served, f"restarted {engine.name} got no traffic: {served}"
    _assert_pools_full(cluster.engines)


def test_kill_prefill_engine_under_load(cluster: ChaosCluster, reference: Reference) -> None:
    victim = cluster.by_role("prefill")[0]

    async def kill() -> None:
        # A tiny prefill takes milliseconds: stopped first for a moment, the victim surely
        # holds requests when it dies (it was sent some), as a crash under real load would.
        victim.signal(signal.SIGSTOP)
        await asyncio.sleep(0.25)
        victim.kill()

    before = _retries(cluster)
    outs = asyncio.run(_load(cluster, reference, _mix(40, stream_every=4), 8, fault=kill))
    after = _retries(cluster)
    victim.start()  # boots (seconds) while the survivors are checked
    survivors = [e for e in cluster.engines if e is not victim]
    waited = _assert_pools_full(survivors)
    _report(cluster, "kill-prefill", outs, retries_p=after[0] - before[0],
            pools_full_after=f"{waited:.1f}s")
    _check(outs, 40)  # the other P took over: no non-streaming request failed
    assert victim.url in {o.prefill for o in outs}  # it was serving when it died
    assert after[0] > before[0], "no request was cut by the kill"
    _restart_and_check(cluster, victim, reference, "kill-prefill", started=True)


def test_kill_decode_engine_mid_stream(cluster: ChaosCluster, reference: Reference) -> None:
    victim = cluster.by_role("decode")[0]
    killed: list[Outcome] = []

    def kill_mid_stream(out: Outcome) -> None:
        # A few events in: in notify/push the first one may be P's token, sent before D
        # even started; by the third D is streaming.
        if out.decode == victim.url and out.events == 3 and not killed:
            killed.append(out)
            victim.kill()

    async def scenario() -> tuple[list[Outcome], list[Outcome]]:
        streams = asyncio.create_task(_load(
            cluster, reference, _mix(12, stream_every=1, max_tokens=LONG), 6,
            on_event=kill_mid_stream))
        plain = asyncio.create_task(_load(cluster, reference, _mix(24, offset=3), 4))
        return await streams, await plain

    before = _retries(cluster)
    streams, plain = asyncio.run(scenario())
    after = _retries(cluster)
    assert killed, "no stream was served by the victim"
    victim.start()  # boots (seconds) while the survivors are checked
    survivors = [e for e in cluster.engines if e is not victim]
    waited = _assert_pools_full(survivors)
    _report(cluster, "kill-decode", streams + plain, retries_d=after[1] - before[1],
            pools_full_after=f"{waited:.1f}s")
    _check(plain, 24)  # non-streaming: run again on the other D
    # Cut off after the first byte: each of the victim's streams is continued on the other
    # D (mid-stream migration, router/flows/migration.py), so no stream sees an error.
    _check(streams, 12, may_fail=lambda o: False)
    assert killed[0].error is None and killed[0].text == reference[
        killed[0].prompt, killed[0].max_tokens], f"the cut stream: {killed}"
    assert metric(cluster.url, "pdgate_migrations_total", f'mode="{cluster.mode}",'
                  'result="kv"') >= 1
    _restart_and_check(cluster, victim, reference, "kill-decode", started=True)


def test_frozen_prefill_engine(cluster: ChaosCluster, reference: Reference) -> None:
    victim = cluster.by_role("prefill")[1]

    async def freeze() -> None:
        victim.signal(signal.SIGSTOP)

    before = _retries(cluster)
    try:
        outs = asyncio.run(_load(cluster, reference, _mix(40, stream_every=4), 8,
                                 fault=freeze))
    finally:
        victim.signal(signal.SIGCONT)
    after = _retries(cluster)
    _check(outs, 40)  # stalled prefills timed out and went elsewhere
    assert victim.url in {o.prefill for o in outs}
    wait_router_pairs(cluster, 2, 2)  # thawed, it passes health checks again
    # Whatever it pinned while frozen (nobody will read it) goes back by abort or lease.
    waited = _assert_pools_full(cluster.engines)
    _report(cluster, "freeze-prefill", outs, retries_p=after[0] - before[0],
            pools_full_after=f"{waited:.1f}s")
    # Thawed, it may have finished stale prefills: later answers must still be right.
    outs = asyncio.run(_load(cluster, reference, _mix(16, stream_every=4), 4))
    _report(cluster, "freeze-prefill/after-thaw", outs)
    _check(outs, 16, may_fail=lambda o: False)
    assert victim.url in {o.prefill for o in outs}
    _assert_pools_full(cluster.engines)


@pytest.mark.parametrize("cluster", ["notify"], indirect=True)  # no KV-ready in pull/push
def test_kv_ready_notices_dropped(cluster: ChaosCluster, reference: Reference) -> None:
    """P's prefills and WRITEs work but its KV-ready notices never count: restarted with a
    notify secret the router does not have, every notice it signs is dropped by the router's
    proxy (a real mechanism on loopback, no firewall: a secret rotated on one side only)."""
    victim = cluster.by_role("prefill")[0]
    victim.restart(["--notify-secret", WRONG_SECRET])
    wait_healthy(victim, 120)
    wait_router_pairs(cluster, 2, 2)
    def counts() -> tuple[float, float]:
        return (metric(cluster.url, "pdgate_proxy_messages_total", 'result="bad_mac"'),
                metric(cluster.url, "pdgate_early_first_tokens_total", 'result="recompute"'))

    first, before = counts(), _retries(cluster)
    outs = asyncio.run(_load(cluster, reference, _mix(24, stream_every=3), 6))
    last, after = counts(), _retries(cluster)
    dropped, recomputed = last[0] - first[0], last[1] - first[1]
    waited = _assert_pools_full(cluster.engines)  # the victim's too: it still runs
    # Streams whose P token went out before the KV-ready wait ran out: D recomputed.
    _report(cluster, "drop-kv-ready", outs, notices_dropped=int(dropped),
            streams_recomputed=int(recomputed), retries_p=after[0] - before[0],
            pools_full_after=f"{waited:.1f}s")
    _check(outs, 24)  # waited KV_READY_TIMEOUT_S, then ran again on the other P
    assert dropped > 0, "the victim's notices never reached the proxy"
    assert max(o.seconds for o in outs) > KV_READY_TIMEOUT_S  # someone did wait for one
    _restart_and_check(cluster, victim, reference, "drop-kv-ready")
