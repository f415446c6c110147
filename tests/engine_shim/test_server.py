"""The shim's OpenAI API on the tiny model, served by a real uvicorn on a loopback port.

Covers reply shapes (JSON and SSE), greedy output against an independent HF greedy loop,
seeded sampling, stop strings, exact error bodies, and the block pool returning to full after
finished, failed and abandoned requests. The engine-level tests at the end drive `Engine`
directly to check concurrency and preemption against solo runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from pdgate.engine_shim.cli import ConnectorSettings, nixl_connector_factory
from pdgate.engine_shim.engine import Engine, EngineConfig
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.sampler import SamplingParams
from pdgate.engine_shim.sequence import GenerateRequest
from pdgate.engine_shim.transfer_errors import KVTransferError
from tests.engine_shim.live import (
    ADMISSION_TIMEOUT,
    BLOCK_SIZE,
    MODEL,
    NUM_BLOCKS,
    Shim,
    start_shim,
    stop_shim,
)


@pytest.fixture(scope="module")
def shim(tiny_model_dir: Path) -> Iterator[Shim]:
    s = start_shim(tiny_model_dir)
    yield s
    stop_shim(s)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir: Path) -> Any:
    """An independent reference: HF's Llama, greedy, no KV cache, EOS ignored."""
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    def run(ids: list[int], n: int) -> list[int]:
        ids = list(ids)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-n:]

    return run


def complete(shim: Shim, prompt: Any = "Hello world", **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **kw}
    r = shim.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream_events(shim: Shim, path: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    with httpx.stream("POST", shim.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- replies ----


def test_completion_reply_shape_and_greedy_matches_hf(
    shim: Shim, tokenizer: Any, hf_greedy: Any
) -> None:
    body = complete(shim, "The quick brown fox", max_tokens=10)
    prompt_ids = tokenizer.encode("The quick brown fox")
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 10,
                             "total_tokens": len(prompt_ids) + 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    expected = tokenizer.decode(hf_greedy(prompt_ids, 10), skip_special_tokens=True)
    assert choice["text"] == expected
    assert body["kv_transfer_params"] is None


def test_greedy_is_deterministic_and_token_prompts_match_text(shim: Shim, tokenizer: Any) -> None:
    first = complete(shim, "Tell me a story about a cat", max_tokens=12)
    second = complete(shim, "Tell me a story about a cat", max_tokens=12)
    ids = tokenizer.encode("Tell me a story about a cat")
    by_ids = complete(shim, ids, max_tokens=12)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert by_ids["choices"][0]["text"] == first["choices"][0]["text"]


def test_request_id_header_names_the_reply(shim: Shim) -> None:
    r = shim.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                  headers={"X-Request-Id": "req-abc"})
    assert r.status_code == 200
    assert r.json()["id"] == "cmpl-req-abc" and r.headers["x-request-id"] == "req-abc"


def test_chat_reply_uses_the_template(shim: Shim, tokenizer: Any, hf_greedy: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = shim.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                           "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)  # vLLM's chat default
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens"] == len(ids)
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == tokenizer.decode(hf_greedy(ids, 6), skip_special_tokens=True)


def test_streamed_completion_equals_non_streamed(shim: Shim) -> None:
    whole = complete(shim, "Paged attention stores", max_tokens=12)
    events = stream_events(shim, "/v1/completions", {
        "model": MODEL, "prompt": "Paged attention stores", "max_tokens": 12,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_streamed_chat_opens_with_role_and_has_no_usage_unless_asked(shim: Shim) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    whole = shim.post("/v1/chat/completions", body).json()
    events = stream_events(shim, "/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c and c["object"] == "chat.completion.chunk" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible(shim: Shim) -> None:
    kw = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234}
    a = complete(shim, "Once upon a time", **kw)
    b = complete(shim, "Once upon a time", **kw)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_stop_string_cuts_the_text(shim: Shim) -> None:
    full = complete(shim, "Numbers: 0 1 2", max_tokens=20)["choices"][0]["text"]
    stop = full[8:11]
    assert stop and full.find(stop) == 8, "pick a stop string that first occurs at 8"
    cut = complete(shim, "Numbers: 0 1 2", max_tokens=20, stop=[stop, "never-seen"])
    choice = cut["choices"][0]
    assert choice["text"] == full[:8]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    events = stream_events(shim, "/v1/completions", {
        "model": MODEL, "prompt": "Numbers: 0 1 2", "max_tokens": 20, "temperature": 0,
        "ignore_eos": True, "stop": stop, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full[:8]


def test_stop_strings_are_picked_and_cut_as_vllm_does(shim: Shim) -> None:
    """vLLM's `check_stop_strings`: the match that ends first wins (not the one that
    starts first); `include_stop_str_in_output` keeps it and holds no text back."""
    full = complete(shim, "Numbers: 0 1 2", max_tokens=20)["choices"][0]["text"]
    long, short = full[6:11], full[8:10]
    assert full.find(long) == 6 and full.find(short) == 8, f"pick others in {full!r}"
    for include, text in ((False, full[:8]), (True, full[:10])):
        kw = {"max_tokens": 20, "stop": [long, short], "include_stop_str_in_output": include}
        choice = complete(shim, "Numbers: 0 1 2", **kw)["choices"][0]
        assert (choice["text"], choice["stop_reason"]) == (text, short)
        events = stream_events(shim, "/v1/completions", {
            "model": MODEL, "prompt": "Numbers: 0 1 2", "temperature": 0,
            "ignore_eos": True, "stream": True, **kw})
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
        if include:  # nothing held back: each token's text comes in its own chunk
            assert len([e for e in events[:-1] if e["choices"][0]["text"]]) > 1


def test_a_stream_with_token_ids_has_a_chunk_per_token_as_vllm(shim: Shim) -> None:
    """vLLM 0.32 with `return_token_ids`: one chunk per token listing its id, its text empty
    while held back (here: the last len(stop) - 1 characters, for a stop string)."""
    kw = {"max_tokens": 12, "stop": ["never-seen"], "return_token_ids": True}
    whole = complete(shim, "Numbers: 0 1 2", **kw)["choices"][0]
    events = stream_events(shim, "/v1/completions", {
        "model": MODEL, "prompt": "Numbers: 0 1 2", "temperature": 0, "ignore_eos": True,
        "stream": True, **kw})
    choices = [e["choices"][0] for e in events[:-1]]
    assert [len(c["token_ids"]) for c in choices] == [1] * 12
    assert [i for c in choices for i in c["token_ids"]] == whole["token_ids"]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert choices[0]["text"] == ""  # held back: the text is shorter than the stop string


def test_stop_token_ids_and_min_tokens(shim: Shim, tokenizer: Any, hf_greedy: Any) -> None:
    prompt_ids = tokenizer.encode("Hello")
    greedy = hf_greedy(prompt_ids, 6)
    stop_id = greedy[2]
    first = greedy.index(stop_id)  # the stop id may also occur earlier
    body = complete(shim, "Hello", max_tokens=6, stop_token_ids=[stop_id])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert body["usage"]["completion_tokens"] == first + 1  # the stop token is counted...
    # ...but not shown
    assert choice["text"] == tokenizer.decode(greedy[:first], skip_special_tokens=True)
    # min_tokens bans stop ids until enough tokens exist, so the cap is reached instead.
    held = complete(shim, "Hello", max_tokens=6, min_tokens=6, stop_token_ids=[stop_id])
    assert held["choices"][0]["finish_reason"] == "length"
    assert held["usage"]["completion_tokens"] == 6


def test_models_and_health(shim: Shim) -> None:
    assert httpx.get(shim.url + "/health").status_code == 200
    models = httpx.get(shim.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == NUM_BLOCKS * BLOCK_SIZE


# ---- errors ----


def _err(message: str, param: str | None, code: int = 400, kind: str = "BadRequestError") -> Any:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("path", "body", "status", "expected"), [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400,
     _err("only n=1 is supported by the engine shim (send n separate requests)", "n")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400,
     _err("max_tokens must be at least 1, got -1", "max_tokens")),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404,
     _err("The model `nope` does not exist.", "model", 404, "NotFoundError")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400,
     _err("Expected `float | null`, got `str` - at `$.temperature`", "temperature")),
    ("/v1/completions", {"model": MODEL}, 400,
     _err("Object missing required field `prompt`", None)),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400,
     _err("token ids out of range [0, 512): [99999]", "prompt")),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400,
     _err("only one prompt per request is supported (send one request per prompt)", "prompt")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400,
     _err("top_p must be in (0, 1], got 0.0", "top_p")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5},
     400, _err("min_tokens must be in [0, max_tokens=4], got 5", "min_tokens")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400,
     _err("stop strings must be non-empty", "stop")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400,
     _err("logprobs are not supported by the engine shim", "logprobs")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 300}, 400,
     _err("This model's maximum context length is 256 tokens. However, you requested 302 "
          "tokens (2 in the prompt, 300 in the completion). Please reduce the prompt or "
          "max_tokens.", None)),
    ("/v1/completions",
     {"model": MODEL, "prompt": "x", "kv_transfer_params": {"do_remote_decode": "yes"}}, 400,
     _err("invalid kv_transfer_params: Expected `bool`, got `str` - at `$.do_remote_decode`",
          "kv_transfer_params.do_remote_decode")),
    ("/v1/completions",
     {"model": MODEL, "prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}, 400,
     _err("kv_transfer_params with do_remote_prefill needs remote_engine_id, remote_block_ids,"
          " remote_host, remote_port", "kv_transfer_params.remote_engine_id")),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": [TOOL]}, 400,
     _err("tools is not supported by the engine shim", "tools")),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tool_choice": "required"},
     400, _err("tool_choice is not supported by the engine shim", "tool_choice")),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "functions": [TOOL]}, 400,
     _err("functions is not supported by the engine shim", "functions")),
    ("/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "response_format": {"type": "json_object"}}, 400,
     _err('response_format is not supported by the engine shim (only {"type": "text"})',
          "response_format")),
    ("/v1/completions",
     {"model": MODEL, "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}, 400,
     _err("structured_outputs is not supported by the engine shim", "structured_outputs")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "[ab]"}, 400,
     _err("guided_regex is not supported by the engine shim", "guided_regex")),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400,
     _err("messages must be a non-empty list", "messages")),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "priority": "high"}, 400,
     _err("Expected `int`, got `str` - at `$.priority`", "priority")),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400,
     _err("Object missing required field `role` - at `$.messages[0]`", "messages")),
])
def test_bad_input_gets_an_openai_error(
    shim: Shim, path: str, body: dict[str, Any], status: int, expected: Any
) -> None:
    r = shim.post(path, body)
    assert r.status_code == status
    assert r.json() == expected


def test_fields_that_ask_for_nothing_are_served(shim: Shim) -> None:
    """`tool_choice: "none"`, `response_format` text and empty tool lists ask for plain
    text, which the shim gives: the same as without them. vLLM's `priority` is accepted
    (the router forwards it with --forward-priority) and changes nothing."""
    plain = complete(shim, "Hello")
    for extra in ({"tool_choice": "none"}, {"response_format": {"type": "text"}},
                  {"tools": [], "structured_outputs": None},
                  {"priority": -5}, {"priority": 7}):  # accepted, not honoured (FIFO)
        assert complete(shim, "Hello", **extra)["choices"] == plain["choices"], extra


def test_malformed_json_is_a_400(shim: Shim) -> None:
    r = httpx.post(shim.url + "/v1/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"
    assert r.json()["error"]["message"].startswith("request body is not valid JSON")


# ---- the block pool never leaks ----


def test_pool_returns_to_full_after_finished_failed_and_abandoned_requests(shim: Shim) -> None:
    complete(shim, "Hello", max_tokens=30)
    shim.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 3})
    body = {"model": MODEL, "prompt": "A long story " * 5, "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", shim.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # walk away mid-stream: the connection closes here
    shim.wait_pool_full()
    assert shim.metric("pdgate_shim_kv_blocks_leased") == 0


def _hold_all_but_two_blocks(shim: Shim) -> Any:
    """An admitted request that has not started, holding all but 2 of the pool's blocks."""
    return shim.call(shim.engine.open(GenerateRequest(
        request_id="holder", prompt_ids=tuple(range(10, 10 + 4 * (NUM_BLOCKS - 2))),
        sampling=SamplingParams(temperature=0), max_tokens=1)))


def _release(shim: Shim, holder: Any) -> None:
    async def close() -> None:
        holder.close()

    shim.call(close())


def test_requests_wait_for_blocks_fifo_and_503_after_the_timeout(shim: Shim) -> None:
    holder = _hold_all_but_two_blocks(shim)
    small = {"model": MODEL, "prompt": list(range(20, 32)), "max_tokens": 2}  # 3 blocks
    try:
        r = shim.post("/v1/completions", small)
        assert r.status_code == 503
        assert r.json() == _err(
            f"out of KV cache blocks: waited {ADMISSION_TIMEOUT:g}s for 3 blocks (2 of "
            f"{NUM_BLOCKS} free); retry later or send a shorter prompt", None, 503,
            "ServiceUnavailableError")
        # A request that is waiting when blocks come back is served.
        waiting: list[httpx.Response] = []
        client = threading.Thread(target=lambda: waiting.append(shim.post("/v1/completions",
                                                                          small)))
        client.start()
        deadline = time.monotonic() + 10
        while shim.engine.num_waiting == 0:
            assert time.monotonic() < deadline, "the request never queued"
            time.sleep(0.005)
        # What a push-mode P sheds for (engine_shim/push.py): 3 blocks wanted, 2 free.
        assert shim.engine.scheduler.starved_need(0.0) == 1
        assert shim.engine.scheduler.starved_need(3600.0) == 0  # not waited that long
    finally:
        _release(shim, holder)
    client.join(timeout=30)
    assert waiting[0].status_code == 200, waiting[0].text
    assert waiting[0].json()["usage"]["completion_tokens"] == 2
    shim.wait_pool_full()


def test_a_queued_request_whose_client_leaves_gives_up_its_place(tiny_model_dir: Path) -> None:
    """A request waiting for blocks whose client goes away leaves the queue at once, not
    when its turn or the admission timeout comes (60 s here): a router closes the legs of
    a client that left, and dead legs ahead in the FIFO delayed live ones (push mode: tens
    of seconds, tests/e2e/test_push_overload.py)."""
    s = start_shim(tiny_model_dir, admission_timeout=60.0)
    try:
        holder = _hold_all_but_two_blocks(s)
        try:
            small = {"model": MODEL, "prompt": list(range(20, 32)), "max_tokens": 2}
            with pytest.raises(httpx.ReadTimeout):  # queued (3 blocks, 2 free), then left
                httpx.post(s.url + "/v1/completions", json=small,
                           timeout=httpx.Timeout(60.0, read=1.0))
            deadline = time.monotonic() + 30
            while s.engine.num_waiting:
                assert time.monotonic() < deadline, "still queued 30 s after its client left"
                time.sleep(0.01)
        finally:
            _release(s, holder)
        s.wait_pool_full()
    finally:
        stop_shim(s)


# ---- the engine core, driven directly ----


def _greedy(rid: str, prompt: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=tuple(prompt),
                           sampling=SamplingParams(temperature=0), max_tokens=n,
                           ignore_eos=True)


async def _run(engine: Engine, reqs: list[GenerateRequest]) -> list[tuple[str, int]]:
    streams = [await engine.open(r) for r in reqs]  # admit all first, then run together

    async def drain(stream: Any) -> tuple[str, int]:
        text, count = "", 0
        async with stream:
            async for out in stream:
                text, count = text + out.text, out.num_output_tokens
        return text, count

    return list(await asyncio.gather(*(drain(s) for s in streams)))


async def test_concurrent_and_preempted_requests_match_solo_runs(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 12 blocks of 4 = 48 tokens; three requests of 4 + 30 tokens cannot all fit at once, so
    # the engine must preempt and recompute, and still produce each request's solo output.
    engine = Engine.load(
        EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=12),
        ShimMetrics.create(),
    )
    await engine.start()
    try:
        reqs = [_greedy(f"r{i}", [1, 40 + i, 77, 300 - i], 30) for i in range(3)]
        solo = [(await _run(engine, [r]))[0] for r in reqs]
        with caplog.at_level(logging.INFO, logger="pdgate.engine_shim.scheduler"):
            together = await _run(engine, reqs)
        assert "preempting request" in caplog.text
        assert together == solo
        assert all(count == 30 for _, count in together)
        assert engine.pool.num_free == engine.pool.num_total
    finally:
        await engine.stop()


def test_cli_serves_and_shuts_down_on_sigterm(tiny_model_dir: Path) -> None:
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdgate.engine_shim", "--model", str(tiny_model_dir),
         "--served-model-name", MODEL, "--port", str(port), "--no-kv-transfer",
         "--log-level", "warning"],
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the shim exited during startup"
            assert time.monotonic() < deadline, "the shim did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # ignore_eos: an unseeded sample from random weights may hit EOS before 3 tokens.
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                      "max_tokens": 3, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- kv_transfer_params (P/D) ----


class CopyConnector:
    """In-process stand-in for the NIXL connector (same calls, a tensor copy instead of a
    NIXL READ): engines register by engine id; `pull` copies the prefill engine's blocks into
    the decode engine's and releases P's lease, as the reader's notification does."""

    def __init__(self, registry: dict[str, CopyConnector], engine_id: str, engine: Engine):
        self.registry, self.engine_id, self.engine = registry, engine_id, engine
        self.leases: dict[str, list[int]] = {}
        registry[engine_id] = self

    def start(self) -> None:
        pass

    def close(self) -> None:
        for rid in list(self.leases):
            self.abort(rid)

    def leased_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.leases.values())

    def hold_for_remote_decode(self, request_id: str, block_ids: list[int]) -> dict[str, Any]:
        self.leases[request_id] = list(block_ids)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_request_id": request_id,
                "remote_block_ids": list(block_ids), "remote_host": "127.0.0.1",
                "remote_port": 1, "tp_size": 1}

    async def pull(self, params: Any, local_block_ids: list[int]) -> int:
        peer = self.registry.get(params["remote_engine_id"])
        if peer is None:
            raise KVTransferError(f"unknown engine {params['remote_engine_id']}")
        src, dst = peer.engine.kv.planes(), self.engine.kv.planes()
        remote = list(params["remote_block_ids"])
        dst[:, :, local_block_ids] = src[:, :, remote]
        peer.abort(params["remote_request_id"])
        return int(src[:, :, remote].nbytes)

    async def pull_tokens(self, params: Any, local_block_ids: list[int],
                          num_tokens: int) -> int:
        """Same block sizes on both sides: P's blocks go to the first local ones."""
        return await self.pull(params, local_block_ids[:len(params["remote_block_ids"])])

    def abort(self, request_id: str) -> None:
        blocks = self.leases.pop(request_id, None)
        if blocks is not None:
            self.engine.free_blocks(blocks)

    def kv_info(self) -> dict[str, object]:
        return {"engine_id": self.engine_id}

    # Pull only: the notify/push calls refuse, as the Protocol says.
    def push_blocks(self, request_id: str, block_ids: list[int], num_tokens: int,
                    params: Any, first_token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
        raise KVTransferError("this connector cannot push")

    def fail_push(self, request_id: str, reason: str, detail: str) -> None:
        pass

    def expect_landing(self, tag: str) -> None:
        pass

    def forget_landing(self, tag: str) -> None:
        pass

    async def await_landing(self, tag: str, timeout: float) -> tuple[int, ...] | None:
        return None

    async def await_push(self, params: Any, request_id: str, local_block_ids: list[int],
                         num_tokens: int) -> tuple[int, tuple[int, ...]]:
        raise KVTransferError("this connector cannot push")


@pytest.fixture(scope="module")
def pd_pair(tiny_model_dir: Path) -> Iterator[tuple[Shim, Shim]]:
    registry: dict[str, CopyConnector] = {}
    prefill = start_shim(tiny_model_dir, kv_digests=True,
                         connector_factory=lambda e: CopyConnector(registry, "P", e))
    decode = start_shim(tiny_model_dir, kv_digests=True,
                        connector_factory=lambda e: CopyConnector(registry, "D", e))
    yield prefill, decode
    stop_shim(prefill)
    stop_shim(decode)


PD_PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog.",
              "Paged attention stores keys and values in fixed size blocks. " * 4]
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}


def pd_request(prefill: Shim, decode: Shim, prompt: str, rid: str, n: int) -> Any:
    """The router's pull flow: P leg (max_tokens 1), then D leg with P's params."""
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    headers = {"X-Request-Id": rid}
    p = prefill.post("/v1/completions",
                     {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS},
                     headers=headers)
    assert p.status_code == 200, p.text
    params = p.json()["kv_transfer_params"]
    n_prompt = p.json()["usage"]["prompt_tokens"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == -(-n_prompt // BLOCK_SIZE)
    assert prefill.metric("pdgate_shim_kv_blocks_leased") == len(params["remote_block_ids"])
    d = decode.post("/v1/completions",
                    {**body, "max_tokens": n, "kv_transfer_params": params}, headers=headers)
    assert d.status_code == 200, d.text
    assert d.json()["kv_transfer_params"] is None
    assert d.json()["usage"]["prompt_tokens"] == n_prompt
    return d.json()


@pytest.mark.parametrize("prompt", PD_PROMPTS, ids=["one-block", "partial", "many-blocks"])
def test_prefill_then_decode_equals_colocated(pd_pair: tuple[Shim, Shim], prompt: str) -> None:
    prefill, decode = pd_pair
    rid = f"pd-{len(prompt)}"
    d = pd_request(prefill, decode, prompt, rid, 10)
    colocated = complete(decode, prompt, max_tokens=10)
    assert d["choices"][0]["text"] == colocated["choices"][0]["text"]
    n_prompt = colocated["usage"]["prompt_tokens"]
    assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    held = httpx.get(prefill.url + "/debug/kv_transfers").json()["transfers"]
    pulled = httpx.get(decode.url + "/debug/kv_transfers").json()["transfers"]
    p_log = next(t for t in held if t["request_id"] == rid)
    d_log = next(t for t in pulled if t["request_id"] == rid)
    assert (p_log["role"], d_log["role"]) == ("prefill", "decode")
    assert p_log["digest"] == d_log["digest"] and p_log["bytes"] == d_log["bytes"] > 0
    prefill.wait_pool_full()  # the read released P's lease
    decode.wait_pool_full()


def test_failed_pull_recomputes_and_still_answers(pd_pair: tuple[Shim, Shim]) -> None:
    _, decode = pd_pair
    before = recomputes(decode)
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_block_ids": [0],
              "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "x"}
    d = complete(decode, "Hi", max_tokens=6, kv_transfer_params=params)
    assert d["choices"][0]["text"] == complete(decode, "Hi", max_tokens=6)["choices"][0]["text"]
    assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert recomputes(decode) == before + 1
    decode.wait_pool_full()


def test_fail_policy_turns_a_failed_pull_into_a_502(tiny_model_dir: Path) -> None:
    """`--kv-load-failure-policy fail`: no silent recompute; the caller gets a clear 502
    (streaming: an error event) and no block stays allocated."""
    registry: dict[str, CopyConnector] = {}
    decode = start_shim(tiny_model_dir, kv_load_failure_policy="fail",
                        connector_factory=lambda e: CopyConnector(registry, "D", e))
    try:
        params = {"do_remote_prefill": True, "remote_engine_id": "gone",
                  "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": 1,
                  "remote_request_id": "x"}
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "kv_transfer_params": params}
        r = decode.post("/v1/completions", body)
        assert r.status_code == 502, r.text
        assert "could not be loaded" in r.json()["error"]["message"]
        events = stream_events(decode, "/v1/completions", {**body, "stream": True})
        assert any("error" in e for e in events if isinstance(e, dict))
        assert recomputes(decode) == 0
        decode.wait_pool_full()
    finally:
        stop_shim(decode)


def test_streamed_decode_leg_equals_colocated(pd_pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pd_pair
    prompt = PD_PROMPTS[1]
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    p = prefill.post("/v1/completions", {**body, "max_tokens": 1,
                                         "kv_transfer_params": PREFILL_PARAMS},
                     headers={"X-Request-Id": "pd-stream"})
    events = stream_events(decode, "/v1/completions", {
        **body, "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
        "kv_transfer_params": p.json()["kv_transfer_params"]})
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == complete(decode, prompt, max_tokens=9)["choices"][0]["text"]
    assert events[-2]["usage"]["completion_tokens"] == 9
    prefill.wait_pool_full()


def recomputes(shim: Shim) -> float:
    for line in httpx.get(shim.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdgate_shim_requests_total") and 'role="decode"' in line \
                and 'status="recompute"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- the real NIXL connector (P side): params, lease, abort ----


@pytest.fixture(scope="module")
def nixl_prefill(tiny_model_dir: Path) -> Iterator[Shim]:
    factory = nixl_connector_factory(ConnectorSettings(
        engine_id="prefill-test", side_channel_host="127.0.0.1", side_channel_port=0,
        lease_seconds=60.0))
    s = start_shim(tiny_model_dir, connector_factory=factory)
    yield s
    stop_shim(s)


def test_do_remote_decode_returns_params_and_leases_until_abort(nixl_prefill: Shim) -> None:
    shim = nixl_prefill
    r = shim.post("/v1/completions", {
        "model": MODEL, "prompt": "Hello world, how are you today?", "max_tokens": 1,
        "temperature": 0, "ignore_eos": True, "kv_transfer_params": PREFILL_PARAMS},
        headers={"X-Request-Id": "lease-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    params = body["kv_transfer_params"]
    n_blocks = -(-body["usage"]["prompt_tokens"] // BLOCK_SIZE)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-test"
    assert params["remote_request_id"] == "lease-1" and params["tp_size"] == 1
    assert params["remote_host"] == "127.0.0.1" and 0 < params["remote_port"] < 65536
    assert len(set(params["remote_block_ids"])) == n_blocks
    assert body["choices"][0]["finish_reason"] == "length"
    assert shim.metric("pdgate_shim_kv_blocks_leased") == n_blocks
    assert shim.metric("pdgate_shim_kv_blocks_free") == NUM_BLOCKS - n_blocks
    # A request that needs more blocks than are free now is refused while the lease holds.
    too_big = list(range(10, 10 + BLOCK_SIZE * (NUM_BLOCKS - n_blocks) + 1))
    refused = shim.post("/v1/completions", {"model": MODEL, "prompt": too_big, "max_tokens": 1})
    assert refused.status_code == 503, refused.text
    r = shim.post("/v1/kv/abort", {"request_id": "lease-1"})
    assert r.status_code == 200 and r.json() == {"request_id": "lease-1"}
    shim.wait_pool_full()
    assert shim.metric("pdgate_shim_kv_blocks_leased") == 0


def test_abort_validates_its_body(nixl_prefill: Shim) -> None:
    r = nixl_prefill.post("/v1/kv/abort", {"id": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Object missing required field `request_id`"


def test_pd_over_real_nixl_equals_colocated(tiny_model_dir: Path, nixl_prefill: Shim) -> None:
    factory = nixl_connector_factory(ConnectorSettings(
        engine_id="decode-test", side_channel_host="127.0.0.1", side_channel_port=0,
        lease_seconds=60.0))
    decode = start_shim(tiny_model_dir, connector_factory=factory)
    try:
        for i, prompt in enumerate(PD_PROMPTS):
            d = pd_request(nixl_prefill, decode, prompt, f"nixl-{i}", 8)
            colocated = complete(decode, prompt, max_tokens=8)
            assert d["choices"][0]["text"] == colocated["choices"][0]["text"]
            assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == \
                colocated["usage"]["prompt_tokens"] - 1
        nixl_prefill.wait_pool_full()  # D's read notification released every lease
        assert nixl_prefill.metric("pdgate_shim_kv_blocks_leased") == 0
        assert recomputes(decode) == 0
    finally:
        stop_shim(decode)


async def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_model_dir: Path) -> None:
    async def sample_twice(seed: int) -> list[str]:
        engine = Engine.load(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                          num_blocks=32, seed=seed), ShimMetrics.create())
        await engine.start()
        try:
            reqs = [GenerateRequest(request_id=f"s{i}", prompt_ids=(1, 40, 77),
                                    sampling=SamplingParams(temperature=1.0), max_tokens=12,
                                    ignore_eos=True) for i in range(2)]
            return [text for r in reqs for text, _ in await _run(engine, [r])]
        finally:
            await engine.stop()

    first, again = await sample_twice(5), await sample_twice(5)
    assert first == again


# ---- continuing after tokens sampled elsewhere (notify mode's early first token) ----


def test_continuation_after_given_tokens_completes_the_same_generation(
    shim: Shim, tokenizer: Any, hf_greedy: Any
) -> None:
    ids = tokenizer.encode("Numbers: 0 1 2")
    greedy = hf_greedy(ids, 8)
    head = tokenizer.decode(greedy[:2], skip_special_tokens=True)
    assert head and "\ufffd" not in head, "pick a prompt whose first tokens are whole text"
    whole = complete(shim, ids, max_tokens=8)
    rest = complete(shim, ids, max_tokens=8, kv_transfer_params={"first_token_ids": greedy[:2]})
    assert head + rest["choices"][0]["text"] == whole["choices"][0]["text"]
    assert rest["usage"]["completion_tokens"] == 8  # the given tokens count as output
    assert rest["choices"][0]["finish_reason"] == "length"


def test_continuation_after_a_split_character_sends_that_character(
    shim: Shim, tokenizer: Any, hf_greedy: Any
) -> None:
    ids = tokenizer.encode("Hello world")
    [t1] = hf_greedy(ids, 1)
    assert tokenizer.decode([t1]).endswith("\ufffd"), "pick a prompt whose token 1 is split"
    whole = complete(shim, ids, max_tokens=6)
    rest = complete(shim, ids, max_tokens=6, kv_transfer_params={"first_token_ids": [t1]})
    # The client got nothing for token 1 (it was part of a character): all of it comes now.
    assert rest["choices"][0]["text"] == whole["choices"][0]["text"]


def test_streamed_chat_continuation_has_no_role_delta(
    shim: Shim, tokenizer: Any, hf_greedy: Any
) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    [t1] = hf_greedy(tokenizer.encode(text, add_special_tokens=False), 1)
    first = tokenizer.decode([t1], skip_special_tokens=True)
    assert first and "\ufffd" not in first, "pick a message whose first token is whole text"
    events = stream_events(shim, "/v1/chat/completions", {
        **body, "stream": True, "kv_transfer_params": {"first_token_ids": [t1]}})
    chunks = events[:-1]
    assert all("role" not in c["choices"][0]["delta"] for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = shim.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert first + content == whole


@pytest.mark.parametrize("params,message", [
    ({"first_token_ids": [1, 2, 3, 4]},
     "kv_transfer_params.first_token_ids: 4 tokens leave none of max_tokens=4 to generate"),
    ({"first_token_ids": [600]}, "kv_transfer_params.first_token_ids out of range [0, 512)"),
    ({"first_token_ids": [5], "do_remote_decode": True},
     "kv_transfer_params.first_token_ids is for the decode leg"),
])
def test_bad_first_token_ids_are_a_400(shim: Shim, params: dict[str, Any],
                                       message: str) -> None:
    r = shim.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                                      "kv_transfer_params": params})
    assert r.status_code == 400
    assert r.json() == _err(message, "kv_transfer_params.first_token_ids")
