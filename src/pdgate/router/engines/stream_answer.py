"""One non-streaming OpenAI answer assembled from a client-bound SSE stream.

A non-streaming request that may migrate (router/flows/migration.py) runs its decode leg as
a stream the router reads itself: the stream's events, as `ResumeEvents` made them for the
client (router/engines/resume_events.py: token ids removed, a continuation's chunks stamped
with the first leg's `id`, `created` and `model`, chat chunks for chat, usage billed as one
request), are fed here and become the body the client would have got from one engine:

- completions: `object` "text_completion", each choice's `text` the concatenation of its
  chunks' texts;
- chat: `object` "chat.completion", each choice's `message` with the role of its first
  delta ("assistant") and the concatenated `content` (and `reasoning_content`, when the
  engine streams one);
- `finish_reason` and `stop_reason` of each choice: the last non-null ones (the last leg's);
- `usage`: the usage chunk's (the stream asks for it).

An error event (the migration gave up: no continuation could open) becomes the
`RouterError` its `code` names (engine_timeout: 504, engine_unavailable: 502, else 502
EngineError), raised by `body()`, so the client gets the status a failed non-streaming
decode leg has always had; a chunk whose fields have the wrong types is an
`EngineProtocolError` (502) at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdgate.router.errors import (
    EngineError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
    RouterError,
)

__all__ = ["StreamAnswer"]

_encode = msgspec.json.Encoder().encode
_DATA = b"data: "
_DONE = b"data: [DONE]"
_ERRORS: dict[str, type[RouterError]] = {
    "engine_timeout": EngineTimeout, "engine_unavailable": EngineUnavailable}


# The fields of a chunk the answer reads, decoded into structs: a third of the time of
# decoding the chunk into dicts and reading them back (a 16-token stream: 16 µs against
# 42 µs on the 2-core development VM, `timeit`), on every chunk of every such request.
class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None


class _ChunkChoice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: Any = None
    stop_reason: Any = None


class _Chunk(msgspec.Struct):
    id: Any = None
    created: Any = None
    model: Any = None
    choices: list[_ChunkChoice] | None = None
    usage: Any = None
    error: Any = None


_decode = msgspec.json.Decoder(_Chunk).decode


@dataclass(slots=True)
class _Choice:
    index: int
    role: str = "assistant"
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finish_reason: Any = None
    stop_reason: Any = None


class StreamAnswer:
    """Feed whole SSE events (`feed`), then read the answer (`body`). `chat`: the stream
    is chat chunks (`chat.completion.chunk`)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.usage: Any = None
        self.error: RouterError | None = None
        self._choices: dict[int, _Choice] = {}

    def feed(self, events: bytes) -> None:
        """Whole SSE events (`data: ...\\n\\n`, several or one), as a `MigratingStream`
        yields them; comments and `[DONE]` are skipped."""
        for event in events.split(b"\n\n"):
            event = event.strip(b"\n")
            if event.startswith(_DATA) and event != _DONE:
                try:
                    chunk = _decode(event[len(_DATA):])
                except msgspec.ValidationError as exc:
                    raise EngineProtocolError(f"decode engine's chunk: {exc}") from None
                self._chunk(chunk)

    def body(self) -> bytes:
        """The answer's JSON body; raises the stream's error when it ended with one."""
        if self.error is not None:
            raise self.error
        choices = [self._render(c) for _, c in sorted(self._choices.items())]
        out: dict[str, Any] = {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": choices}
        if self.usage is not None:
            out["usage"] = self.usage
        return _encode(out)

    def _chunk(self, chunk: _Chunk) -> None:
        if chunk.error is not None:
            self.error = _error(chunk.error)
            return
        if self.id is None:
            self.id, self.created, self.model = chunk.id, chunk.created, chunk.model
        if chunk.usage:
            self.usage = chunk.usage
        for c in chunk.choices or ():
            choice = self._choices.get(c.index)
            if choice is None:
                choice = self._choices[c.index] = _Choice(c.index)
            self._add(choice, c)

    def _add(self, choice: _Choice, c: _ChunkChoice) -> None:
        if self.chat:
            delta = c.delta
            if delta is not None:
                if delta.role:
                    choice.role = delta.role
                if delta.content:
                    choice.text.append(delta.content)
                if delta.reasoning_content:
                    choice.reasoning.append(delta.reasoning_content)
        elif c.text:
            choice.text.append(c.text)
        if c.finish_reason is not None:
            choice.finish_reason = c.finish_reason
            choice.stop_reason = c.stop_reason

    def _render(self, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        if not self.chat:
            return {"index": c.index, "text": text, "logprobs": None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        message: dict[str, Any] = {"role": c.role, "content": text}
        if c.reasoning:
            message["reasoning_content"] = "".join(c.reasoning)
        return {"index": c.index, "message": message, "logprobs": None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def _error(err: Any) -> RouterError:
    """The error event's error as the router error its code names."""
    if not isinstance(err, dict):
        return EngineError(str(err))
    message = str(err.get("message") or "the decode engine failed mid-response")
    return _ERRORS.get(str(err.get("code")), EngineError)(message)
