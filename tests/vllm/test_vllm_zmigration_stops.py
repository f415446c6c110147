"""Migration of streams with stop strings, with real vLLM 0.32 (pull, NixlConnector): a
decode engine killed (kill -9) mid-stream; the router continues the stream on the other
decode engine, and the client gets what one engine alone sends (router/engines/resume_text.py).

What vLLM 0.32 streams for such a request (`return_token_ids`, as the router asks): one
chunk per token, its id listed, its text empty while the detokenizer holds the last
`max(len(stop)) - 1` characters back (none with `include_stop_str_in_output`) or the token
ends inside a character; the held text comes with the final chunk.

- `after`: a stop string (excluded) beyond the kill: the continuation's engine finds it.
- `across`: a stop string (included) that begins just before the client's text at the
  kill and runs 48 characters on: the continuation keeps part of it and its engine never
  sees it whole; the router ends the stream there (and logs it).

Each case starts its OWN victim decode engine and kills it (the session's P, D and REF stay
untouched); its router has P, and the victim and D round-robin.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import metric
from tests.vllm.conftest import ENGINE_START_TIMEOUT_S, VllmCluster
from tests.vllm.processes import ENGINE_KEY, SERVED_NAME, Proc, start_vllm, wait_ready
from tests.vllm.test_vllm_pd import IGNORE_EOS, unique_prompt
from tests.vllm.test_vllm_zmigration import D2_CORE, ROUTER_ARGS, _kill_group

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 64
KILL_AFTER = 12  # chunks with text the client has before the victim dies
ACROSS_LEN = 48
ACROSS_LOG = "across the cut of continuation"
HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}


@pytest.fixture
def victim(vllm_cluster: VllmCluster, request: pytest.FixtureRequest) -> Iterator[Proc]:
    c = vllm_cluster
    proc = start_vllm(c.python, c.model_dir, f"D-{request.node.callspec.id}", c.log_dir,
                      core=D2_CORE)
    try:
        wait_ready([proc], "/health", ENGINE_START_TIMEOUT_S)
        yield proc
    finally:
        proc.stop()


class Stream:
    """One greedy stream's client side."""

    def __init__(self) -> None:
        self.texts: list[str] = []  # the text after each chunk with text
        self.finish: list[tuple[str, Any]] = []
        self.usage: dict[str, int] = {}
        self.decode = ""

    @property
    def text(self) -> str:
        return self.texts[-1] if self.texts else ""


async def _stream(url: str, prompt: str, stop: dict[str, Any], victim: Proc | None
                  ) -> Stream:
    """A greedy stream from `url` (a router or an engine); when `victim` serves it,
    `victim` is killed once the client has KILL_AFTER chunks with text."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **IGNORE_EOS, **stop}
    s = Stream()
    async with httpx.AsyncClient(timeout=600, headers=HEADERS) as client, \
            client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        s.decode = r.headers.get("x-pdgate-decode-engine", "")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                assert choice.get("token_ids") is None  # vLLM itself lists null
                if choice["text"]:
                    s.texts.append(s.text + choice["text"])
                if choice["finish_reason"] is not None:
                    s.finish.append((choice["finish_reason"], choice.get("stop_reason")))
            s.usage = event.get("usage") or s.usage
            if victim is not None and s.decode == victim.url and len(s.texts) == KILL_AFTER:
                await asyncio.to_thread(_kill_group, victim)
    return s


async def _stop_for(ref: str, prompt: str, kind: str) -> dict[str, Any]:
    """The stop fields of `kind` for `prompt`, placed by the colocated stream without one."""
    plain = await _stream(ref, prompt, {}, None)
    full, at = plain.text, len(plain.texts[KILL_AFTER - 1])
    if kind == "across":
        return {"stop": [full[at - 2:at - 2 + ACROSS_LEN]], "include_stop_str_in_output": True}
    start = next(i for i in range(at + 30, len(full) - 4) if full.find(full[i:i + 4]) == i)
    return {"stop": [full[start:start + 4]]}


@pytest.mark.parametrize("kind", ["after", "across"])
async def test_stop_strings_of_a_migrated_stream(vllm_cluster: VllmCluster, victim: Proc,
                                                 kind: str) -> None:
    c = vllm_cluster
    router = c.start_router(f"router-migration-{kind}", [c.p.url], [victim.url, c.d.url],
                            ROUTER_ARGS)
    for _ in range(2):  # both decode engines handshake with P before the kill
        await _stream(router.url, unique_prompt(20), {}, None)
    for _ in range(2):  # round-robin: one of two streams lands on the victim
        prompt = unique_prompt(40)
        stop = await _stop_for(c.ref.url, prompt, kind)
        got = await _stream(router.url, prompt, stop, victim)
        if got.decode == victim.url:
            break
    assert got.decode == victim.url and not victim.alive(), "no stream was served by it"
    want = await _stream(c.ref.url, prompt, stop, None)
    router_log = router.log_tail(200_000)
    print(f"\nMIGRATION vllm stops={kind} stop={stop['stop']!r} text {len(got.text)} chars "
          f"finish {got.finish} usage {got.usage} (colocated {want.usage}) router stops "
          f"{router_log.count(ACROSS_LOG)}")
    assert (got.text, got.finish) == (want.text, want.finish)
    assert want.finish[0][0] == "stop" and want.finish[0][1] == stop["stop"][0]
    assert metric(router.url, "pdgate_migrations_total", 'mode="pull",result="kv"') == 1
    assert got.usage["prompt_tokens"] == want.usage["prompt_tokens"]
    if kind == "after":
        assert got.usage == want.usage
        assert ACROSS_LOG not in router_log
    else:  # the tokens relayed, up to the chunk that completed the match
        assert want.usage["completion_tokens"] <= got.usage["completion_tokens"] <= MAX_TOKENS
        assert ACROSS_LOG in router_log
