"""Mid-stream migration's logic (router/flows/migration.py, resume.py, engines/resume_events.py)
on streams written here: which requests may migrate, the continuation's budget and body,
what the client gets across a cut (chat chunks, one id, one usage, a split character), and
that a continuation failing again is bounded. The real thing, engines killed under load in
every mode, is tests/chaos/test_migration.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from pdgate.router.engines.resume_events import ResumeEvents
from pdgate.router.errors import EngineUnavailable
from pdgate.router.flows.base import StreamResult
from pdgate.router.flows.migration import OFF, MigrationMetrics, Migrator
from pdgate.router.flows.resume import continuation_body, declined, remaining_budget
from pdgate.router.input.schema import ChatParams, ClientRequest, CompletionParams
from pdgate.router.policies import PickContext

PROMPT_IDS = [11, 12, 13]
ERROR = b'data: {"error": {"message": "engine reset", "type": "x", "code": 502}}\n\n'
DONE = b"data: [DONE]\n\n"


def _req(body: dict[str, Any], chat: bool = False) -> ClientRequest:
    body = {"model": "m", "stream": True, **body}
    if chat:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        params: Any = msgspec.convert(body, ChatParams)
        return ClientRequest("chat", "/v1/chat/completions", body, params, "r1", {})
    body.setdefault("prompt", "hello")
    params = msgspec.convert(body, CompletionParams)
    return ClientRequest("completion", "/v1/completions", body, params, "r1", {},
                         prompt=body["prompt"])


@pytest.mark.parametrize(("body", "reason"), [
    ({"temperature": 0, "max_tokens": 8}, None),
    ({"stop": ["\n"]}, None),  # tests/router/test_migration_stops.py
    ({"stop": "x"}, None),
    ({"stop": [""]}, "stop"),
    ({"stop": []}, None),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "logprobs"),
    ({"n": 2}, "n"),
    ({"best_of": 3}, "n"),
    ({"presence_penalty": 0.5}, "sampling"),
    ({"min_tokens": 3}, "sampling"),
    ({"response_format": {"type": "json_object"}}, "structured"),
    ({"return_token_ids": True}, "token_ids"),
    ({"stream_options": {"continuous_usage_stats": True}}, "usage_stats"),
])
def test_which_completion_streams_may_migrate(body: dict[str, Any], reason: str | None) -> None:
    assert declined(_req(body), 4096) == reason


def test_chat_without_a_budget_migrates_only_when_the_context_length_is_known() -> None:
    assert declined(_req({}, chat=True), None) == "no_budget"
    assert declined(_req({}, chat=True), 4096) is None
    assert declined(_req({"max_completion_tokens": 9}, chat=True), None) is None
    assert declined(_req({"tools": [{"type": "function"}]}, chat=True), 4096) == "structured"


def test_the_continuation_gets_what_is_left_of_the_budget() -> None:
    assert remaining_budget(_req({"max_tokens": 10}), 4, 3, None) == 6
    assert remaining_budget(_req({}), 4, 3, None) == 12  # completions default: 16
    chat = _req({"max_completion_tokens": 20}, chat=True)
    assert remaining_budget(chat, 5, 30, None) == 15
    assert remaining_budget(_req({}, chat=True), 5, 30, 100) == 65  # the context left


def test_a_chat_continuation_is_a_completion_over_ids() -> None:
    req = _req({"max_completion_tokens": 20, "temperature": 0, "seed": 7, "top_p": 0.9,
                "stream_options": {"include_usage": False}, "chat_template_kwargs": {}},
               chat=True)
    body = continuation_body(req, [*PROMPT_IDS, 5, 6], 18)
    assert body == {"model": "m", "temperature": 0, "seed": 7, "top_p": 0.9,
                    "prompt": [*PROMPT_IDS, 5, 6], "max_tokens": 18, "stream": True,
                    "stream_options": {"include_usage": True}}
    plain = continuation_body(_req({"max_tokens": 9, "kv_transfer_params": {"x": 1}}),
                              [1, 2], 4)
    assert plain["prompt"] == [1, 2] and plain["max_tokens"] == 4
    assert "kv_transfer_params" not in plain


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _completion(text: str, ids: list[int], finish: str | None = None, cid: str = "cmpl-b"
                ) -> bytes:
    return _sse({"id": cid, "object": "text_completion", "created": 2, "model": "m",
                 "choices": [{"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish, "stop_reason": None,
                              "token_ids": ids}]})


def _usage(prompt: int, completion: int, cid: str = "cmpl-b") -> bytes:
    return _sse({"id": cid, "object": "text_completion", "created": 2, "model": "m",
                 "choices": [], "usage": {"prompt_tokens": prompt,
                                          "completion_tokens": completion,
                                          "total_tokens": prompt + completion}})


def _events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_a_chat_stream_continues_in_chat_chunks_with_one_id_and_one_usage() -> None:
    ev = ResumeEvents(chat=True, wants_usage=True)
    role = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "prompt_token_ids": PROMPT_IDS,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}]}
    word = {**role, "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None,
                                 "finish_reason": None, "token_ids": [5]}]}
    del word["prompt_token_ids"]
    out = ev.feed(_sse(role) + _sse(word)) + ev.feed(ERROR + DONE)
    assert ev.failure is not None and ev.ids == [5] and ev.clean == 1
    ev.continue_as(len(PROMPT_IDS))
    out += ev.feed(_completion(" there", [6]) + _completion("!", [7], "length")
                   + _usage(len(PROMPT_IDS) + 1, 2)) + ev.end()
    events = _events(out)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {"chatcmpl-a"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in chunks)
    assert all("token_ids" not in ch for c in chunks for ch in c["choices"])
    assert [ch["delta"].get("content") for c in chunks for ch in c["choices"]] == [
        "", "Hi", " there", "!"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                   "total_tokens": 6}


def test_tokens_whose_text_was_held_back_are_generated_again() -> None:
    # vLLM sends a token that ends inside a multi-byte character with empty text: the
    # client has no text for it, so the continuation must not keep it.
    ev = ResumeEvents(chat=False, wants_usage=False)
    out = ev.feed(_completion("a", [5], cid="cmpl-a") + _completion("", [6], cid="cmpl-a"))
    ev.feed(ERROR + DONE)
    assert (ev.ids, ev.clean) == ([5, 6], 1)
    ev.continue_as(3)
    assert ev.ids == [5]
    out += ev.feed(_completion("é", [6, 7]) + _usage(4, 2)) + ev.end()
    events = _events(out)
    assert [c["choices"][0]["text"] for c in events[:-1]] == ["a", "é"]
    assert events[-1] == "[DONE]"  # no usage chunk: the client did not ask


def test_an_engine_without_token_ids_is_not_migrated() -> None:
    ev = ResumeEvents(chat=False, wants_usage=False)
    ev.feed(_sse({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "text": "a", "finish_reason": None}]}))
    assert ev.untracked


class _Legs:
    """Continuations that each relay one token, then fail like a dead engine (or, when
    `refuse`, fail to open)."""

    def __init__(self, refuse: bool = False) -> None:
        self.requests: list[ClientRequest] = []
        self.avoided: list[frozenset[str]] = []
        self.refuse = refuse

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        self.requests.append(req)
        n = len(self.requests)
        self.avoided.append(PickContext.of(req).avoid)
        if self.refuse:
            raise EngineUnavailable("no decode engine answers")
        req.served_by["prefill"] = "p"
        req.served_by["decode"] = f"http://d{n}"
        return StreamResult(_leg(_completion(f"<{n}>", [100 + n]) + ERROR + DONE),
                            lambda: None)


async def _leg(*pieces: bytes) -> AsyncGenerator[bytes, None]:
    for piece in pieces:
        yield piece


async def _tokenize(req: ClientRequest) -> None:
    req.prompt_token_ids = list(PROMPT_IDS)


def _migrator(legs: _Legs, registry: CollectorRegistry, *, non_streaming: bool = False
              ) -> Migrator:
    return Migrator(legs.run, _tokenize, MigrationMetrics.create(registry), "pull",
                    max_migrations=2, deadline_s=30.0, max_model_len=None,
                    non_streaming=non_streaming)


async def _serve(m: Migrator, req: ClientRequest, first: bytes) -> list[Any]:
    reason = m.prepare(req)
    assert reason is None and req.track_ids
    result = m.wrap(req, StreamResult(_leg(first), lambda: None), reason)
    assert isinstance(result, StreamResult)
    raw = b"".join([piece async for piece in result.chunks])
    result.close()
    return _events(raw)


async def test_a_continuation_that_fails_again_is_bounded() -> None:
    registry = CollectorRegistry()
    legs = _Legs()
    m = _migrator(legs, registry)
    req = _req({"max_tokens": 10, "temperature": 0})
    req.served_by["decode"] = "http://d0@1"  # rank 1 of a data-parallel engine
    events = await _serve(m, req, _completion("a", [5], cid="cmpl-a") + ERROR + DONE)
    # Two continuations (each one more token), then the limit: the error event, one [DONE].
    assert [e["choices"][0]["text"] for e in events[:-2]] == ["a", "<1>", "<2>"]
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-2]} == {"cmpl-a"}
    assert [r.body["prompt"] for r in legs.requests] == [
        [*PROMPT_IDS, 5], [*PROMPT_IDS, 5, 101]]
    assert [r.body["max_tokens"] for r in legs.requests] == [9, 8]
    assert [r.request_id for r in legs.requests] == ["r1-m1", "r1-m2"]
    assert all(r.track_ids for r in legs.requests)
    # Each continuation avoids every decode engine that failed the stream (all ranks).
    assert legs.avoided == [{"http://d0"}, {"http://d0", "http://d1"}]
    count = registry.get_sample_value
    assert count("pdgate_migrations_total", {"mode": "pull", "result": "kv"}) == 2
    assert count("pdgate_migrations_total", {"mode": "pull", "result": "limit"}) == 1
    assert count("pdgate_migration_resume_gap_seconds_count", {"mode": "pull"}) == 2


async def test_continuations_that_cannot_open_end_the_stream_with_the_error() -> None:
    registry = CollectorRegistry()
    legs = _Legs(refuse=True)
    events = await _serve(_migrator(legs, registry), _req({"max_tokens": 10}),
                          _completion("a", [5], cid="cmpl-a") + ERROR + DONE)
    assert [e["choices"][0]["text"] for e in events[:-2]] == ["a"]
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert len(legs.requests) == 2
    assert registry.get_sample_value(
        "pdgate_migrations_total", {"mode": "pull", "result": "failed"}) == 2


async def test_a_stream_that_had_finished_just_ends_with_its_usage() -> None:
    registry = CollectorRegistry()
    legs = _Legs()
    req = _req({"max_tokens": 2, "stream_options": {"include_usage": True}})
    events = await _serve(_migrator(legs, registry), req,
                          _completion("a", [5], cid="cmpl-a")
                          + _completion("b", [6], "length", cid="cmpl-a") + ERROR + DONE)
    assert not legs.requests
    assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert events[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                  "total_tokens": 5}
    assert events[3:] == ["[DONE]"]


def test_requests_migration_does_not_look_at() -> None:
    m = _migrator(_Legs(), CollectorRegistry())
    assert m.prepare(_req({"stream": False})) == OFF  # without --migrate-non-streaming
    assert m.prepare(_req({"logprobs": 1})) == "logprobs"
    m = _migrator(_Legs(), CollectorRegistry(), non_streaming=True)
    # A non-streaming request that cannot migrate keeps the plain non-streaming legs.
    assert m.prepare(_req({"stream": False, "logprobs": 1})) == OFF
    plain = _req({"stream": False})
    assert m.prepare(plain) is None and plain.track_ids
    off = Migrator(_Legs().run, _tokenize, MigrationMetrics.create(CollectorRegistry()),
                   "pull", max_migrations=0, deadline_s=30.0, max_model_len=None)
    assert off.prepare(_req({})) == OFF and off.prepare(_req({"stream": False})) == OFF
