"""pdgate's router in push mode (`--pd-mode push`) in front of REAL vLLM engines started
with `NixlPushConnector`: both legs at once, D registers its blocks with P, P WRITEs.

This module starts its own push-mode engines (prefill engine PA on core 0, decode engine D
on core 1) and stops them at its end. PA also serves as the colocated reference (a request
without `kv_transfer_params` is an ordinary one). The router learns each prefill engine's
NIXL identity from its first answer. Tool calls go through recording relays in front of
PA and D (tests/vllm/tool_calls.py). The 2P1D tests start a second prefill engine PB beside
PA; the last kills PB under load and restarts it on the same ports under a new engine id,
which the router learns again. The last two run a TP 2 push engine as P in front of D, then
as D behind PA.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.cluster import metric
from tests.vllm.conftest import ENGINE_START_TIMEOUT_S, LOG_DIR
from tests.vllm.processes import (
    SERVED_NAME,
    Proc,
    push_connector,
    restart,
    start_router,
    start_vllm,
    wait_ready,
)
from tests.vllm.recording import Proxies, Recorder
from tests.vllm.test_vllm_pd import (
    IGNORE_EOS,
    acomplete,
    check_kv_over_nixl,
    client,
    complete,
    early_prompt,
    kv_sources,
    unique_prompt,
)
from tests.vllm.test_vllm_zfault import _holds_nothing, _load_with_kill, _recovered, _routed
from tests.vllm.tool_calls import TOOL_CHOICES, check_tool_calls

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_push, pytest.mark.timeout(900)]

PUSH_LOGS = LOG_DIR / "push"
# D keeps core 1 to itself; the prefill engines share core 0.
CORES = {"PA": "0", "D": "1", "PB": "0"}
MAX_TOKENS = 12  # as test_vllm_zfault's helpers generate
ROUTER_ARGS = [
    "--pd-mode", "push", "--prefill-policy", "round-robin",
    # 5 s: a busy 2-core machine kept D's /health past 1 s, and the router then had no
    # decode engine (503) while D was fine.
    "--health-interval-s", "1", "--health-timeout-s", "5",
    "--prefill-timeout-s", "60", "--decode-first-byte-timeout-s", "120",
    "--kv-ready-timeout-s", "30",
    "--max-retries", "1", "--eject-consecutive-errors", "3", "--breaker-open-s", "2",
]


@dataclass
class Push:
    """This module's engines and routers."""

    python: Path
    model_dir: Path
    pa: Proc  # also the colocated reference
    d: Proc
    procs: list[Proc]  # every process started (restarts too), stopped at the module's end

    def router(self, name: str, prefill: list[Proc], decode: Proc | None = None) -> Proc:
        """A push-mode router in front of `prefill` and `decode` (default D)."""
        proc = start_router(self.model_dir, [p.url for p in prefill], [(decode or self.d).url],
                            PUSH_LOGS / name, ROUTER_ARGS)
        self.procs.append(proc)
        wait_ready([proc], "/ready", 60.0)
        return proc


def _push_config(name: str) -> dict[str, object]:
    # A fresh engine id per start: vLLM's push connector keys a peer's NIXL agent by engine
    # id, so a restarted engine must not reuse its old one (docs/vllm.md).
    return push_connector(f"{name}-{uuid.uuid4().hex[:8]}")


def _start_push_engine(python: Path, model_dir: Path, name: str) -> Proc:
    return start_vllm(python, model_dir, name, PUSH_LOGS, core=CORES[name],
                      kv_config=_push_config(name))


@pytest.fixture(scope="module")
def push(vllm_python: Path, vllm_model_dir: Path, vllm_log_dir: Path) -> Iterator[Push]:
    procs = [_start_push_engine(vllm_python, vllm_model_dir, name) for name in ("PA", "D")]
    try:
        wait_ready(procs, "/health", ENGINE_START_TIMEOUT_S)
        yield Push(vllm_python, vllm_model_dir, procs[0], procs[1], procs)
    finally:
        for proc in reversed(procs):  # routers first; one slow stop must not skip the rest
            try:
                proc.stop()
            except Exception as exc:  # noqa: BLE001 -- keep stopping the others
                print(f"stopping {proc.name} (pid {proc.popen.pid}) failed: {exc!r}")


@pytest.fixture(scope="module")
def router_1p(push: Push) -> Proc:
    return push.router("router-push-1p", [push.pa])


def _logs(push: Push) -> str:
    return "\n".join(p.log_tail() for p in push.procs)


def test_completion_kv_pushed_not_recomputed(push: Push, router_1p: Proc) -> None:
    """The first request to PA learns its identity (P, then D); the second sends both
    legs at once. Both: greedy text equal to a colocated engine's, and D's own metrics
    count every prompt token as loaded over NIXL, none computed."""
    for _ in range(2):
        prompt = unique_prompt(60)
        external0, local0 = kv_sources(push.d.url)
        raw = client(router_1p.url).completions.with_raw_response.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=16, temperature=0,
            extra_body=IGNORE_EOS)
        done = raw.parse()
        external1, local1 = kv_sources(push.d.url)
        assert raw.headers["x-pdgate-prefill-engine"] == push.pa.url
        assert raw.headers["x-pdgate-decode-engine"] == push.d.url
        colocated = complete(push.pa.url, prompt, 16)
        assert done.choices[0].text == colocated.choices[0].text
        assert done.usage is not None and colocated.usage is not None
        assert done.usage.prompt_tokens == colocated.usage.prompt_tokens
        assert external1 - external0 == done.usage.prompt_tokens, _logs(push)
        assert local1 == local0
    assert metric(router_1p.url, "pdgate_fallbacks_total") == 0


def _chat(url: str, content: str, **extra: Any) -> Any:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": content}]
    return client(url).chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=12, temperature=0,
        extra_body=IGNORE_EOS, **extra)


def test_chat_and_streaming_equal_colocated(push: Push, router_1p: Proc) -> None:
    """Chat, streaming chat and streaming completions through push: the colocated text,
    and each stream's prompt arrived over NIXL."""
    content = f"{uuid.uuid4().hex} Tell me a story about a cat."
    via_router = _chat(router_1p.url, content)
    colocated = _chat(push.pa.url, content)
    assert via_router.choices[0].message.content == colocated.choices[0].message.content

    content = f"{uuid.uuid4().hex} Tell me a story about a dog."
    external0, local0 = kv_sources(push.d.url)
    chunks = list(_chat(router_1p.url, content, stream=True,
                        stream_options={"include_usage": True}))
    external1, local1 = kv_sources(push.d.url)
    colocated = _chat(push.pa.url, content)
    streamed = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    assert streamed == colocated.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == colocated.usage.prompt_tokens
    assert external1 - external0 == usage.prompt_tokens, _logs(push)
    assert local1 == local0

    prompt = unique_prompt(40)
    streamed_text = "".join(x.choices[0].text for x in client(router_1p.url).completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        extra_body=IGNORE_EOS) if x.choices)
    assert streamed_text == complete(push.pa.url, prompt, 12).choices[0].text


def test_a_stream_opens_with_the_prefill_token_and_equals_colocated(
    push: Push, router_1p: Proc,
) -> None:
    """Push mode's early first token: P's reply (asked for `return_token_ids`) opens the
    stream; D continues from the prompt ids plus P's token, registering its blocks with P,
    which pushes the prompt's KV. The stream is the colocated text, and D computed at most
    P's token itself."""
    early = ("pdgate_early_first_tokens_total", 'result="kv"')
    before = metric(router_1p.url, *early)
    external0, local0 = kv_sources(push.d.url)
    prompt = early_prompt(push.pa.url, 60)  # D's prefix cache cannot serve it
    stream = client(router_1p.url).completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    colocated = complete(push.pa.url, prompt, 12)
    assert streamed == colocated.choices[0].text
    assert metric(router_1p.url, *early) == before + 1, _logs(push)
    assert colocated.usage is not None
    external1, local1 = kv_sources(push.d.url)
    assert external1 - external0 >= colocated.usage.prompt_tokens, _logs(push)
    assert local1 - local0 <= 1
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (colocated.usage.prompt_tokens, 12)


async def test_concurrent_requests_all_pushed(push: Push, router_1p: Proc) -> None:
    prompts = [unique_prompt(10 + 6 * i) for i in range(6)]
    external0, local0 = kv_sources(push.d.url)
    via_router = await asyncio.gather(*(acomplete(router_1p.url, p, 8) for p in prompts))
    external1, local1 = kv_sources(push.d.url)
    colocated = [await acomplete(push.pa.url, p, 8) for p in prompts]
    assert [r.choices[0].text for r in via_router] == [x.choices[0].text for x in colocated]
    assert external1 - external0 == sum(x.usage.prompt_tokens for x in colocated if x.usage)
    assert local1 == local0


@pytest.fixture(scope="module")
def recorded(push: Push) -> Iterator[tuple[Proc, Recorder, Recorder]]:
    """A push router whose legs to PA and D pass through recording relays."""
    proxies = Proxies([push.pa.url, push.d.url])
    p, d = proxies.recorders
    try:
        proc = start_router(push.model_dir, [p.url], [d.url], PUSH_LOGS / "router-push-tools",
                            ROUTER_ARGS)
        push.procs.append(proc)
        wait_ready([proc], "/ready", 60.0)
        yield proc, p, d
    finally:
        proxies.close()


@pytest.mark.parametrize("kind", list(TOOL_CHOICES))
def test_tool_calls_answer_as_the_colocated_engine(
    push: Push, recorded: tuple[Proc, Recorder, Recorder], kind: str,
) -> None:
    """`tools` with `tool_choice` `required`, a named function and `auto` through push,
    streamed and not: PA's colocated answer, a forced call that fits the tool's schema,
    and both legs carried the tool fields (tests/vllm/tool_calls.py)."""
    router, p, d = recorded
    check_tool_calls(router.url, push.pa.url, p, d, kind)
    assert metric(router.url, "pdgate_fallbacks_total") == 0  # pushed, not pulled


@pytest.fixture(scope="module")
def pb(push: Push) -> Proc:
    """The second prefill engine (stopped with the module's other processes)."""
    pb = _start_push_engine(push.python, push.model_dir, "PB")
    push.procs.append(pb)
    wait_ready([pb], "/health", ENGINE_START_TIMEOUT_S)
    return pb


@pytest.fixture(scope="module")
def router_2p(push: Push, pb: Proc) -> Proc:
    return push.router("router-push-2p", [push.pa, pb])


def test_two_prefill_engines_both_push(push: Push, pb: Proc, router_2p: Proc) -> None:
    """2P1D, round-robin: each prefill engine's identity is learnt on its first request
    and D gets every prompt's KV from whichever engine prefilled it."""
    external0, local0 = kv_sources(push.d.url)
    served, prompt_tokens = [], 0
    for _ in range(4):
        prompt = unique_prompt(30)
        engine, done = asyncio.run(_routed(router_2p.url, prompt))
        served.append(engine)
        assert done.usage is not None
        prompt_tokens += done.usage.prompt_tokens
        assert done.choices[0].text == complete(push.pa.url, prompt, MAX_TOKENS).choices[0].text
    external1, local1 = kv_sources(push.d.url)
    assert served == [push.pa.url, pb.url, push.pa.url, pb.url]
    assert external1 - external0 == prompt_tokens, _logs(push)
    assert local1 == local0


def _restart_new_id(dead: Proc) -> Proc:
    """The same engine again (HTTP and NIXL side-channel ports) under a new engine id."""
    argv = [str(a) for a in cast("list[str]", dead.popen.args)]
    at = argv.index("--kv-transfer-config") + 1
    argv[at] = json.dumps(_push_config(dead.name.split("-")[0]))
    return restart(dead, PUSH_LOGS, argv)


async def test_prefill_engine_killed_and_restarted(push: Push, pb: Proc,
                                                   router_2p: Proc) -> None:
    """kill -9 PB while 12 requests run 4 at a time: every request returns the colocated
    text (legs cut off by the kill are retried on PA). PB restarted on the same ports under
    a new engine id: the router's cached identity is stale, D's leg naming it fails, P's
    answer names the new one and D's leg is sent again; D then gets KV from PB again."""
    before = _recovered(router_2p.url)
    prompts = [unique_prompt(20 + 8 * (i % 4)) for i in range(12)]
    results = await _load_with_kill(router_2p.url, prompts, pb, kill_after=3)
    colocated = [await acomplete(push.pa.url, p, MAX_TOKENS) for p in prompts]
    assert [r.choices[0].text for _, r in results] == [x.choices[0].text for x in colocated]
    assert _recovered(router_2p.url) > before, _logs(push)
    # No decode leg is left open on D. Not its blocks: vLLM 0.32's push D keeps the blocks
    # it registered with the killed engine until that engine WRITEs (docs/vllm.md).
    await _holds_nothing(push.d, blocks=False)

    dead = pb
    restarted = _restart_new_id(dead)
    push.procs.append(restarted)
    wait_ready([restarted], "/health", ENGINE_START_TIMEOUT_S)
    external0, local0 = kv_sources(push.d.url)
    served: list[str] = []
    prompt_tokens = 0
    for _ in range(20):  # the router takes PB back within a health interval or two
        prompt = unique_prompt(30)
        engine, done = await _routed(router_2p.url, prompt)
        served.append(engine)
        assert done.usage is not None
        prompt_tokens += done.usage.prompt_tokens
        assert done.choices[0].text == (await acomplete(push.pa.url, prompt, MAX_TOKENS)
                                        ).choices[0].text
        if served.count(dead.url) >= 2:
            break
        await asyncio.sleep(0.5)
    assert served.count(dead.url) >= 2, served
    external1, local1 = kv_sources(push.d.url)
    assert external1 - external0 == prompt_tokens, _logs(push)  # every prompt pushed
    assert local1 == local0


@pytest.fixture(scope="module")
def tp2(push: Push) -> Proc:
    """A push engine with `--tensor-parallel-size 2`, both ranks on core 0 beside the
    prefill engines (D keeps core 1; docs/vllm.md "Verified on CPU")."""
    engine = start_vllm(push.python, push.model_dir, "TP2", PUSH_LOGS, core="0|0",
                        kv_config=_push_config("TP2"),
                        extra_args=["--tensor-parallel-size", "2"])
    push.procs.append(engine)
    wait_ready([engine], "/health", ENGINE_START_TIMEOUT_S)
    return engine


@pytest.mark.vllm_tp
def test_tp2_prefill_engine_pushes_to_a_tp1_decode_engine(push: Push, tp2: Proc) -> None:
    """P's two workers each WRITE their heads into D's one (vLLM's TP mapping from the
    `tp_size` the router passes in D's leg): colocated text, the prompt over NIXL."""
    router = push.router("router-push-tp2-p", [tp2])
    check_kv_over_nixl(router.url, push.d.url, push.pa.url)
    assert metric(router.url, "pdgate_fallbacks_total") == 0  # pushed, not pulled


@pytest.mark.vllm_tp
def test_tp1_prefill_engine_pushes_to_a_tp2_decode_engine(push: Push, tp2: Proc) -> None:
    router = push.router("router-push-tp2-d", [push.pa], decode=tp2)
    check_kv_over_nixl(router.url, tp2.url, push.pa.url)
    assert metric(router.url, "pdgate_fallbacks_total") == 0
