"""1P1D pull mode end to end: real shim engines, real NIXL, real router, the openai SDK."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, burst, complete, metric, start_cluster, wait_pools_full

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed size blocks. " * 12,
]
# Tiny model geometry (engine_shim/tiny.py) at block size 4, float32: bytes of one block of
# one layer's K or V.
BLOCK_BYTES = 4 * 2 * 16 * 4
LAYERS = 2


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # An alias beside the engines' own name (`tiny`): the router rewrites it for them.
    c = start_cluster(tmp_path_factory.mktemp("pd"), tiny_model_dir,
                      extra=["--router-arg=--served-model-name=org/alias"])
    yield c
    c.stop()


def test_openai_sdk_completions_chat_and_streaming(cluster: Cluster) -> None:
    import openai

    client = openai.OpenAI(base_url=cluster.router + "/v1", api_key="unused")
    done = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.usage.prompt_tokens > 0 and done.choices[0].text

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 6

    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens == chat.usage.prompt_tokens


def test_a_served_alias_reaches_the_engines_under_their_name(cluster: Cluster) -> None:
    listed = httpx.get(cluster.router + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["tiny", "org/alias"]
    by_alias = complete(cluster.router, "An alias for the same model", model="org/alias")
    by_name = complete(cluster.router, "An alias for the same model")
    assert by_alias["choices"][0]["text"] == by_name["choices"][0]["text"]
    # Straight to an engine, the alias is unknown: the rewrite is what made it work.
    direct = httpx.post(cluster.prefill[0] + "/v1/completions", timeout=30,
                        json={"model": "org/alias", "prompt": "x", "max_tokens": 1})
    assert direct.status_code == 404


@pytest.mark.parametrize("prompt", PROMPTS, ids=["1-block", "3-blocks", "many-blocks"])
def test_disaggregated_greedy_equals_colocated(cluster: Cluster, prompt: str) -> None:
    read_before = metric(cluster.decode[0], "pdgate_shim_kv_transfer_bytes_total", "read")
    via_router = complete(cluster.router, prompt)
    read_bytes = metric(cluster.decode[0], "pdgate_shim_kv_transfer_bytes_total", "read")
    colocated = complete(cluster.decode[0], prompt)
    assert via_router["choices"][0]["text"] == colocated["choices"][0]["text"]
    assert via_router["usage"]["prompt_tokens"] == colocated["usage"]["prompt_tokens"]
    # D read exactly the prompt's blocks: every layer, K and V.
    n_blocks = -(-colocated["usage"]["prompt_tokens"] // 4)
    assert read_bytes - read_before == n_blocks * LAYERS * 2 * BLOCK_BYTES


def stream_text(url: str, body: dict[str, object]) -> tuple[str, list[dict[str, Any]], float]:
    """A streamed completion's text, its events and the seconds to its first data event."""
    t0 = time.perf_counter()
    first: float | None = None
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                first = first if first is not None else time.perf_counter() - t0
                events.append(json.loads(line[6:]))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    return text, events, first or 0.0


@pytest.mark.parametrize("prompt", PROMPTS, ids=["1-block", "3-blocks", "many-blocks"])
def test_a_stream_opens_with_the_prefill_token_and_equals_colocated(
    cluster: Cluster, prompt: str,
) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    early = ("pdgate_early_first_tokens_total", 'result="kv"')
    before = metric(cluster.router, *early)
    read_before = metric(cluster.decode[0], "pdgate_shim_kv_transfer_bytes_total", "read")
    text, events, _ = stream_text(cluster.router, body)
    colocated = complete(cluster.decode[0], prompt, max_tokens=12)
    # P's token first, then D's continuation: the colocated generation, token for token.
    assert text == colocated["choices"][0]["text"]
    assert metric(cluster.router, *early) == before + 1
    # D continued over the transferred KV (it read the prompt's blocks, computed none).
    n_blocks = -(-colocated["usage"]["prompt_tokens"] // 4)
    read = metric(cluster.decode[0], "pdgate_shim_kv_transfer_bytes_total", "read")
    assert read - read_before == n_blocks * LAYERS * 2 * BLOCK_BYTES
    # Billed as the client's request, not D's continuation (prompt + P's token).
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        colocated["usage"]["prompt_tokens"], 12)


def test_a_prompt_filling_its_blocks_streams_ds_first_token_and_says_why(
    cluster: Cluster,
) -> None:
    """16 prompt tokens fill four blocks of 4 exactly: D's prompt of one token more would
    span a block P does not hold (vLLM's decode engine asserts on it), so the stream keeps
    the plain flow, counted under `full_block`; 17 tokens leave room."""
    withheld = ("pdgate_early_first_tokens_withheld_total", 'reason="full_block"')
    opened = ("pdgate_early_first_tokens_total", 'result="kv"')
    split = ("pdgate_early_first_tokens_withheld_total", 'reason="partial_character"')
    for n, fills in ((16, True), (17, False)):
        ids = list(range(100, 100 + n))
        body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "stream": True}
        before = [metric(cluster.router, *m) for m in (withheld, opened, split)]
        text, _, _ = stream_text(cluster.router, body)
        assert text == complete(cluster.decode[0], ids, max_tokens=8)["choices"][0]["text"]
        after = [metric(cluster.router, *m) for m in (withheld, opened, split)]
        if fills:
            assert after == [before[0] + 1, before[1], before[2]], n
        else:  # P's token opened the stream, or it was part of a character (counted)
            assert after[0] == before[0] and after[1] + after[2] == before[1] + before[2] + 1


def test_transferred_kv_bytes_equal_prefill_bytes(cluster: Cluster) -> None:
    rid = f"kv-digest-{time.monotonic_ns()}"
    resp = httpx.post(cluster.router + "/v1/completions", headers={"X-Request-Id": rid},
                      json={"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 4}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Request-Id"] == rid
    rid = resp.headers["X-Pdgate-Request-Id"]  # engines know the request by the router's id
    held = httpx.get(cluster.prefill[0] + "/debug/kv_transfers", timeout=5).json()
    pulled = httpx.get(cluster.decode[0] + "/debug/kv_transfers", timeout=5).json()
    p = next(t for t in held["transfers"] if t["request_id"].startswith(rid))
    d = next(t for t in pulled["transfers"] if t["request_id"].startswith(rid))
    assert p["role"] == "prefill" and d["role"] == "decode"
    assert d["bytes"] > 0 and p["digest"] and p["digest"] == d["digest"]


def test_block_pools_return_to_free_after_burst(cluster: Cluster) -> None:
    asyncio.run(burst(cluster, PROMPTS, full=10, abandoned=6, first_max_tokens=8))
    wait_pools_full(cluster)


def test_sample_request_and_clean_shutdown(tiny_model_dir: Path, tmp_path: Path) -> None:
    """What `make run` does: the demo request prints an answer and moved KV; SIGINT (Ctrl-C)
    ends every child process."""
    from tests.e2e.cluster import child_pids, pid_alive

    c = start_cluster(tmp_path, tiny_model_dir, demo=True)
    children = child_pids(c.proc.pid)
    assert len(children) == 3
    import signal

    assert c.stop(signal.SIGINT) == 0
    out = c.console + (c.proc.stdout.read() if c.proc.stdout else "")
    assert "answer" in out and "KV bytes moved" in out, out
    assert "the built-in tiny model has random weights, so this text is gibberish" in out, out
    moved = int(out.split("KV bytes moved  :")[1].split()[0])
    assert moved > 0, out
    assert not [p for p in children if pid_alive(p)]


def test_invalid_requests_get_openai_errors(cluster: Cluster) -> None:
    cases = [
        ({"model": "nope", "prompt": "x"}, 404),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400),
        ({"model": "tiny", "messages": []}, 400),
    ]
    for body, status in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(cluster.router + path, json=body, timeout=30)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"]
    r = httpx.post(cluster.router + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in json.loads(r.text)

    # What the shim does not implement is refused by name, through the router too, never
    # answered with unconstrained text.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    for field, value in (("tools", [tool]), ("response_format", {"type": "json_object"})):
        r = httpx.post(cluster.router + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": messages, field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "not supported by the engine shim" in err["message"]
