"""Streams with stop strings, migrated: a real 1P2D cluster (shim engines, NIXL, router) on
loopback, in every P/D mode, `kill -9` of a decode engine while 20 streams run, every stream
with a stop string placed around the point where the kill falls
(router/engines/resume_text.py).

- `after`: the stop string (excluded from the text, so the engines hold back its length
  less one character) lies beyond the kill: the continuation's engine must find it.
- `across`: the stop string (`include_stop_str_in_output`: nothing held back) begins just
  before the text the victim's first stream has when the kill fires and runs 80 characters
  on: the continuation keeps part of it, its engine never sees it whole, and the router
  must end the stream there.

What each client must see is what the engine alone sends for the same body: the same text,
`finish_reason` and `stop_reason`, one id, no SSE error event, one `[DONE]`; usage billed as
one request, with the tokens one engine would have counted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdgate.engine_shim.tiny import TINY_MODEL_NAME
from tests.chaos.cluster import (
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
# Long enough that a victim's stream is still running when the kill lands: the router and
# the engine run ahead of the client that fires it, and a stream ends at its stop string.
ACROSS_LEN = 80
PROMPTS = [f"Stream {i} stops somewhere in the middle of what the tiny model says." for i in
           range(N_STREAMS)]
CHAT = frozenset(PROMPTS[3::4])
DEADLINE_S = 60.0
ACROSS_LOG = "across the cut of continuation"


@dataclass
class Seen:
    """What one client saw."""

    status: int = 0
    decode: str | None = None
    ids: set[str] = field(default_factory=set)
    texts: list[str] = field(default_factory=list)  # the text after each event
    finish: list[tuple[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dones: int = 0
    usage: dict[str, int] | None = None
    lost: str | None = None

    @property
    def text(self) -> str:
        return self.texts[-1] if self.texts else ""

    def event(self, data: str) -> None:
        if data == "[DONE]":
            self.dones += 1
            return
        obj = json.loads(data)
        if "error" in obj:
            self.errors.append(obj["error"].get("message", ""))
            return
        self.ids.add(obj["id"])
        text = self.text
        for c in obj["choices"]:
            assert "token_ids" not in c, "token ids leaked to a client that did not ask"
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            if c.get("finish_reason") is not None:
                self.finish.append((c["finish_reason"], c.get("stop_reason")))
        self.texts.append(text)
        if obj.get("usage"):
            self.usage = obj["usage"]


def _path(prompt: str) -> str:
    return "/v1/chat/completions" if prompt in CHAT else "/v1/completions"


def _body(prompt: str, stop: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": TINY_MODEL_NAME, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}, **stop}
    if prompt in CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _direct(url: str, prompt: str, stop: dict[str, Any]) -> Seen:
    seen = Seen()
    with httpx.stream("POST", url + _path(prompt), json=_body(prompt, stop), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.event(line[6:])
    assert seen.usage is not None and not seen.errors
    return seen


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[list[Engine], int]]:
    started, port = start_engines(tmp_path_factory.mktemp("migration-stops"), tiny_model_dir,
                                  prefill=1, decode=2)
    try:
        yield started, port
    finally:
        stop_engines(started)


def _stops(url: str, kind: str) -> dict[str, tuple[dict[str, Any], int]]:
    """Per prompt: its stop fields and the event after which the kill may fire (a third of
    the way through its stream without a stop string; the client reads behind the router,
    so the victim has sent more by the time it dies)."""
    out = {}
    for prompt in PROMPTS:
        plain = _direct(url, prompt, {})
        k = len(plain.texts) // 3
        full, at = plain.text, len(plain.texts[k - 1])
        if kind == "across":
            start = max(0, at - 2)
            stop = {"stop": [full[start:start + ACROSS_LEN]],
                    "include_stop_str_in_output": True}
        else:  # four characters that first occur in the last third, well after the kill
            start = next(i for i in range(max(at + 20, 2 * len(full) // 3), len(full) - 4)
                         if full.find(full[i:i + 4]) == i)
            stop = {"stop": [full[start:start + 4], "never in this text"]}
        out[prompt] = stop, k
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, stop: dict[str, Any],
                  seen: Seen, victim: Engine, kill_at: int, killed: list[Seen]) -> None:
    try:
        async with asyncio.timeout(DEADLINE_S), client.stream(
                "POST", url + _path(prompt), json=_body(prompt, stop)) as r:
            seen.status = r.status_code
            seen.decode = r.headers.get("x-pdgate-decode-engine")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen.event(line[6:])
                    if (seen.decode == victim.url and len(seen.texts) == kill_at
                            and not killed):
                        killed.append(seen)
                        victim.kill()
    except (TimeoutError, httpx.HTTPError) as exc:
        seen.lost = repr(exc)


async def _run(url: str, stops: dict[str, tuple[dict[str, Any], int]], victim: Engine
               ) -> tuple[dict[str, Seen], list[Seen]]:
    seen = {p: Seen() for p in PROMPTS}
    killed: list[Seen] = []
    limits = httpx.Limits(max_connections=N_STREAMS, max_keepalive_connections=N_STREAMS)
    async with httpx.AsyncClient(timeout=DEADLINE_S, limits=limits) as client:
        tasks = []
        for p in PROMPTS:
            stop, k = stops[p]
            tasks.append(asyncio.create_task(
                _stream(client, url, p, stop, seen[p], victim, k, killed)))
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
    return seen, killed


@pytest.mark.parametrize("kind", ["after", "across"])
@pytest.mark.parametrize("mode", ["pull", "notify", "push"])
def test_stop_strings_of_migrated_streams(mode: str, kind: str,
                                          engines: tuple[list[Engine], int],
                                          tiny_model_dir: Path) -> None:
    started, port = engines
    restart_down(started)
    decode = [e for e in started if e.role == "decode"]
    stops = _stops(decode[0].url, kind)
    want = {p: _direct(decode[0].url, p, stops[p][0]) for p in PROMPTS}
    log = started[0].log.parent / "router.log"  # every router of the module appends to it
    log_from = log.stat().st_size if log.exists() else 0
    cluster = start_router(started, port, tiny_model_dir, mode)
    victim = decode[0]
    try:
        with paced(victim):
            seen, killed = asyncio.run(_run(cluster.url, stops, victim))
        assert killed, "no stream was served by the victim"
        router_log = log.read_bytes()[log_from:].decode(errors="replace")
        kv = metric(cluster.url, "pdgate_migrations_total", f'mode="{mode}",result="kv"')
        across = router_log.count(ACROSS_LOG)
        print(f"\nMIGRATION mode={mode} stops={kind} on_victim="
              f"{sum(s.decode == victim.url for s in seen.values())} migrations_kv={kv} "
              f"router_stops={across}")
        for p, s in seen.items():
            _assert_as_uninterrupted(p, s, want[p])
        assert kv >= 1, "no migration was counted"
        if kind == "across":
            assert across >= 1, "no stream was ended at a stop string across the cut"
        else:
            assert across == 0
    finally:
        cluster.stop()
        if not victim.running:
            victim.start()
            wait_healthy(victim, 120)


def _assert_as_uninterrupted(prompt: str, s: Seen, want: Seen) -> None:
    where = f"{prompt!r} (decode {s.decode})"
    assert s.lost is None, f"{where}: lost: {s.lost}"
    assert s.status == 200, where
    assert s.errors == [], f"{where}: SSE error event {s.errors}"
    assert s.dones == 1, f"{where}: {s.dones} [DONE]"
    assert len(s.ids) == 1, f"{where}: chunk ids {s.ids}"
    assert s.text == want.text, f"{where}: text {s.text!r}, want {want.text!r}"
    assert s.finish == want.finish, f"{where}: finish {s.finish}, want {want.finish}"
    assert s.usage is not None and want.usage is not None, where
    # Also when the router ended it: it counts up to the token whose text showed the
    # match, as the engine does.
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [s.usage[k] for k in keys] == [want.usage[k] for k in keys], (
        f"{where}: usage {s.usage}, want {want.usage}")
