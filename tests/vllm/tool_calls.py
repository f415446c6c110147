"""Real tool calls through P/D, one check for every flow (pull and notify's pull fallback in
test_vllm_fields.py, push in test_vllm_push.py).

Every engine of the suite serves tool calls (processes.TOOL_ARGS: vLLM's `pythonic` parser,
which needs no special tokens in the tiny tokenizer's vocabulary). A forced call (`required`,
or a named function) is a constrained decode: vLLM turns the tool's parameters into a JSON
schema for its structured-output backend, so even the random-weight model answers with a
call whose `arguments` validate against that schema. `auto` is not constrained: the tiny
model's answer is text the parser finds no call in. Each answer through the router must be
the colocated engine's, streaming and not, and P and D must have seen the client's tool
fields.

A stream is compared by what its deltas add up to and by its shape, not chunk by chunk:
vLLM's API server merges the deltas of several engine steps into one chunk when its
consumer falls behind (RequestOutputCollector.put in vllm/v1/engine/output_processor.py),
so where one stream's boundaries fall depends on the moment, on any engine (CI failed on
an `auto` stream that was cut differently through push than on the colocated engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema

from tests.vllm.processes import ENGINE_KEY, SERVED_NAME
from tests.vllm.recording import Recorder

CHAT_PATH = "/v1/chat/completions"
HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}
CHAT = [{"role": "user", "content": "What is the weather like in Paris today?"}]
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": WEATHER_PARAMS}}
TOOL_CHOICES: dict[str, Any] = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
    "auto": "auto",
}
# vLLM's finish_reason for a forced call that ended: "tool_calls" for `required`, "stop" for
# a named function (OpenAI's convention, vllm/entrypoints/openai/chat_completion/serving.py).
FORCED_FINISH = {"required": "tool_calls", "named": "stop"}
# The client's fields each leg must carry unchanged.
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def tool_body(choice: str, *, stream: bool = False) -> dict[str, Any]:
    """A greedy chat request with the weather tool and `TOOL_CHOICES[choice]`."""
    body: dict[str, Any] = {
        "model": SERVED_NAME, "messages": CHAT, "temperature": 0, "tools": [WEATHER_TOOL],
        "tool_choice": TOOL_CHOICES[choice], "stream": stream,
        # A forced call needs ~20 tokens here (the tiny vocabulary spells JSON a character
        # at a time); `auto` is unconstrained text, a few tokens show its shape.
        "max_tokens": 12 if choice == "auto" else 80,
        # One call: `required`'s schema is an array of calls, and without a bound a random
        # model goes on to a second call and runs out of tokens before the array closes.
        "parallel_tool_calls": False,
    }
    return body


@dataclass
class Answer:
    """What a client got: the choices (ids and timestamps removed: they differ between
    any two answers) and, for a stream, each chunk's choices and the message they add up
    to."""

    choices: list[dict[str, Any]]
    chunks: list[list[dict[str, Any]]] | None = None


def _strip(choice: dict[str, Any]) -> dict[str, Any]:
    choice.pop("token_ids", None)
    part = choice.get("message") or choice.get("delta") or {}
    for call in part.get("tool_calls") or []:
        call.pop("id", None)
    return choice


def ask(url: str, body: dict[str, Any]) -> Answer:
    """POST `body` to `url`'s chat route; a 200 is required (the engine's error otherwise)."""
    r = httpx.post(url + CHAT_PATH, json=body, headers=HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return Answer([_strip(c) for c in r.json()["choices"]])
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [[_strip(c) for c in json.loads(e)["choices"]] for e in events[:-1]]
    return Answer(_assemble(chunks), chunks)


def _assemble(chunks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The one choice a stream's deltas add up to, shaped as a non-streamed choice's
    `message` and `finish_reason` (tool calls by index: name once, arguments in pieces)."""
    content, finish = "", None
    calls: dict[int, dict[str, Any]] = {}
    for choices in chunks:
        for c in choices:
            assert c["index"] == 0
            delta = c["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                slot = calls.setdefault(call["index"], {"name": None, "arguments": ""})
                slot["name"] = slot["name"] or fn.get("name")
                slot["arguments"] += fn.get("arguments") or ""
            finish = c.get("finish_reason") or finish
    message = {"content": content, "tool_calls": [calls[i] for i in sorted(calls)]}
    return [{"message": message, "finish_reason": finish}]


def stream_shape(answer: Answer) -> None:
    """A chat stream as vLLM shapes one: the assistant's role in the first chunk only, the
    finish_reason in one chunk, after which no delta adds to the message."""
    chunks = answer.chunks
    assert chunks, "no chunk"
    roles = [i for i, cs in enumerate(chunks) for c in cs if c["delta"].get("role")]
    assert roles == [0] and chunks[0][0]["delta"]["role"] == "assistant", roles
    finished = [i for i, cs in enumerate(chunks) for c in cs if c.get("finish_reason")]
    assert len(finished) == 1, finished
    after = [c["delta"] for cs in chunks[finished[0] + 1:] for c in cs]
    assert not any(d.get("content") or d.get("tool_calls") for d in after), after


def check_forced_call(choice: dict[str, Any], kind: str) -> dict[str, Any]:
    """A forced call's structure: one call of get_weather whose arguments validate against
    the tool's parameters, and the finish_reason vLLM gives that kind. Returns the
    arguments."""
    message = choice["message"]
    calls = message["tool_calls"]
    assert len(calls) == 1, message
    fn = calls[0]["function"] if "function" in calls[0] else calls[0]
    assert fn["name"] == "get_weather"
    args: dict[str, Any] = json.loads(fn["arguments"])
    jsonschema.validate(args, WEATHER_PARAMS)
    assert choice["finish_reason"] == FORCED_FINISH[kind], choice
    return args


def check_tool_calls(router: str, ref: str, p: Recorder, d: Recorder, kind: str) -> None:
    """`kind` of `TOOL_CHOICES` through `router` (in front of the recorders `p` and `d`)
    and on the colocated engine `ref`, non-streamed then streamed: the same choices (a
    stream: the same message from its deltas, in vLLM's shape), the structure of a call,
    and both legs carried the client's tool fields."""
    plain = tool_body(kind)
    via, colocated = ask(router, plain), ask(ref, plain)
    assert via.choices == colocated.choices
    legs_carried(p, d, plain)
    streamed = tool_body(kind, stream=True)
    via_s, colocated_s = ask(router, streamed), ask(ref, streamed)
    assert via_s.choices == colocated_s.choices
    stream_shape(via_s)
    legs_carried(p, d, streamed)

    choice, assembled = via.choices[0], via_s.choices[0]
    if kind == "auto":
        # The parser found no call in the tiny model's text: plain content, cut at max_tokens.
        assert choice["message"]["content"] and not choice["message"].get("tool_calls")
        assert choice["finish_reason"] == "length"
        assert assembled["message"]["content"] == choice["message"]["content"]
        assert not assembled["message"]["tool_calls"]
        return
    args = check_forced_call(choice, kind)
    assert check_forced_call(assembled, kind) == args  # the stream makes the same call


def legs_carried(p: Recorder, d: Recorder, body: dict[str, Any]) -> None:
    """The last chat bodies P and D received carry `body`'s tool fields unchanged, P's as a
    one-token prefill."""
    p_leg, d_leg = p.seen(CHAT_PATH)[-1], d.seen(CHAT_PATH)[-1]
    for key in TOOL_FIELDS:
        assert p_leg[key] == d_leg[key] == body[key], key
    assert p_leg["messages"] == d_leg["messages"] == body["messages"]
    assert p_leg["max_tokens"] == 1 and p_leg["stream"] is False
    assert d_leg["stream"] is body["stream"] and d_leg["max_tokens"] == body["max_tokens"]
    assert "kv_transfer_params" in p_leg and "kv_transfer_params" in d_leg
