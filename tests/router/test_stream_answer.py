"""A non-streaming request that may migrate (router/flows/migration.py `Migrator.answer`):
its stream, as the client-bound events `ResumeEvents` makes, assembled into one OpenAI
answer (router/engines/stream_answer.py): completions and chat, `finish_reason` of the last
leg, usage billed as one request, and a migration that gives up as the decode leg's error.
Engines killed mid-generation under real processes: tests/chaos/test_migration.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pdgate.router.engines.stream_answer import StreamAnswer
from pdgate.router.errors import (
    EngineError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
)
from pdgate.router.flows.base import StreamResult
from pdgate.router.flows.migration import OFF
from pdgate.router.input.schema import ClientRequest
from tests.router.test_migration import (
    DONE,
    ERROR,
    PROMPT_IDS,
    _completion,
    _leg,
    _Legs,
    _migrator,
    _req,
    _sse,
    _usage,
)


def _chat(delta: dict[str, Any], finish: str | None = None, cid: str = "chatcmpl-a"
          ) -> bytes:
    return _sse({"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish, "stop_reason": None}]})


def test_a_completion_stream_becomes_one_text_completion() -> None:
    a = StreamAnswer(chat=False)
    a.feed(_completion("Hel", [1], cid="cmpl-a") + _completion("lo", [2], cid="cmpl-a"))
    a.feed(_completion("!", [3], "length", cid="cmpl-a") + _usage(4, 3, cid="cmpl-a") + DONE)
    body = json.loads(a.body())
    assert body == {"id": "cmpl-a", "object": "text_completion", "created": 2, "model": "m",
                    "choices": [{"index": 0, "text": "Hello!", "logprobs": None,
                                 "finish_reason": "length", "stop_reason": None}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 3,
                              "total_tokens": 7}}


def test_a_chat_stream_becomes_one_chat_completion() -> None:
    a = StreamAnswer(chat=True)
    a.feed(_chat({"role": "assistant", "content": ""}) + _chat({"content": "Hi"}))
    a.feed(_chat({"content": " there"}) + _chat({}, "stop"))
    a.feed(_sse({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1,
                 "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}))
    body = json.loads(a.body())
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-a"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                         "content": "Hi there"},
                                "logprobs": None, "finish_reason": "stop",
                                "stop_reason": None}]
    assert body["usage"]["total_tokens"] == 11


@pytest.mark.parametrize(("code", "error"), [
    ("engine_timeout", EngineTimeout), ("engine_unavailable", EngineUnavailable),
    ("engine_error", EngineError), (502, EngineError)])
def test_a_stream_that_ends_with_an_error_event_raises_its_error(
        code: Any, error: type[Exception]) -> None:
    a = StreamAnswer(chat=False)
    a.feed(_completion("a", [1]))
    a.feed(_sse({"error": {"message": "engine reset", "type": "x", "code": code}}) + DONE)
    with pytest.raises(error, match="engine reset"):
        a.body()


def test_a_chunk_with_fields_of_the_wrong_type_is_the_engines_fault() -> None:
    with pytest.raises(EngineProtocolError):
        StreamAnswer(chat=False).feed(_sse({"id": "c", "choices": [{"index": "zero"}]}))


class _Finishing(_Legs):
    """Continuations that finish: the rest of the budget's tokens, then usage."""

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        self.requests.append(req)
        req.served_by["prefill"] = "p"
        left = req.body["max_tokens"]
        pieces = [_completion(f"<{i}>", [200 + i], "length" if i == left - 1 else None)
                  for i in range(left)]
        prompt = len(req.body["prompt"])
        return StreamResult(_leg(*pieces, _usage(prompt, left), DONE), lambda: None)


@pytest.mark.parametrize("chat", [False, True])
async def test_a_non_streaming_request_migrates_and_gets_one_answer(chat: bool) -> None:
    registry = CollectorRegistry()
    legs = _Finishing()
    m = _migrator(legs, registry, non_streaming=True)
    req = _req({"stream": False, "max_tokens": 4, "temperature": 0}, chat=chat)
    assert m.prepare(req) is None
    first: list[ClientRequest] = []

    async def run(inner: ClientRequest) -> bytes | StreamResult:
        first.append(inner)
        head = _chat({"role": "assistant", "content": ""}) + _chat({"content": "a"}) \
            if chat else _completion("a", [5], cid="cmpl-a")
        # Token id 5's text in the chat stream's content chunk: the ids ride on it.
        head = head.replace(b'"content": "a"}', b'"content": "a"}, "token_ids": [5]')
        return StreamResult(_leg(head, ERROR, DONE), lambda: None)

    body = json.loads(await m.answer(req, run))
    # The flow ran the request as a stream with usage, its ids tracked; the client's
    # request is untouched.
    assert first[0].stream and first[0].wants_usage_chunks and first[0].track_ids
    assert first[0].body["stream"] is True and req.body["stream"] is False
    assert [r.body["prompt"] for r in legs.requests] == [[*PROMPT_IDS, 5]]
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert text == "a<0><1><2>"
    assert choice["finish_reason"] == "length"
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert registry.get_sample_value(
        "pdgate_migrations_total", {"mode": "pull", "result": "kv"}) == 1


async def test_an_engine_without_token_ids_gets_the_plain_retry_from_the_start() -> None:
    legs = _Legs()
    registry = CollectorRegistry()
    m = _migrator(legs, registry, non_streaming=True)
    req = _req({"stream": False, "max_tokens": 4})
    assert m.prepare(req) is None
    runs: list[ClientRequest] = []

    async def run(r: ClientRequest) -> bytes | StreamResult:
        runs.append(r)
        if r.stream:  # text without ids, then the engine dies
            untracked = _completion("a", [5]).replace(b', "token_ids": [5]', b"")
            return StreamResult(_leg(untracked, ERROR, DONE), lambda: None)
        return b'{"plain": true}'

    assert await m.answer(req, run) == b'{"plain": true}'
    assert [r.stream for r in runs] == [True, False]
    assert not req.track_ids and not legs.requests  # no continuation, no ids asked
    assert registry.get_sample_value("pdgate_migrations_declined_total",
                                     {"reason": "no_token_ids"}) == 1


def test_non_streaming_requests_with_stream_options_keep_the_plain_path() -> None:
    m = _migrator(_Legs(), CollectorRegistry(), non_streaming=True)
    assert m.prepare(_req({"stream": False, "stream_options": {"include_usage": True}})) \
        == OFF


async def test_a_non_streaming_request_whose_migration_gives_up_gets_the_error() -> None:
    legs = _Legs(refuse=True)
    m = _migrator(legs, CollectorRegistry(), non_streaming=True)
    req = _req({"stream": False, "max_tokens": 4})
    assert m.prepare(req) is None

    async def run(inner: ClientRequest) -> bytes | StreamResult:
        return StreamResult(_leg(_completion("a", [5], cid="cmpl-a"), ERROR, DONE),
                            lambda: None)

    with pytest.raises(EngineError, match="engine reset"):
        await m.answer(req, run)
    assert len(legs.requests) == 2  # --max-migrations continuations tried


async def test_a_client_that_leaves_closes_the_decode_leg() -> None:
    m = _migrator(_Legs(), CollectorRegistry(), non_streaming=True)
    req = _req({"stream": False, "max_tokens": 4})
    assert m.prepare(req) is None
    closed: list[bool] = []
    started = asyncio.Event()

    async def endless() -> AsyncGenerator[bytes, None]:
        yield _completion("a", [5])
        started.set()
        await asyncio.Event().wait()  # the engine generates on
        yield b""

    async def run(inner: ClientRequest) -> bytes | StreamResult:
        return StreamResult(endless(), lambda: closed.append(True))

    task = asyncio.create_task(m.answer(req, run))
    await started.wait()
    task.cancel()  # the client disconnected (router/http/api.py `until_disconnected`)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]
