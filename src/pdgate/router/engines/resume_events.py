"""The client-bound SSE of a stream the router may migrate (router/flows/migration.py), read
event by event, so that a continuation can take over exactly where the client is.

The decode legs of such a stream ask for `return_token_ids` on the router's behalf
(`ClientRequest.track_ids`); `ResumeEvents` takes the ids out of every chunk before the
client sees it and keeps:
- `ids`: the generated token ids the client's text comes from, in order;
- `clean`: how many of them a continuation keeps (router/engines/resume_text.py: an engine
  holds back the text of a token that ends inside a multi-byte character, and with stop
  strings the last characters of the text, so the client's text does not end where its
  tokens do): the continuation generates the rest again, and the text of it the client
  already has is dropped; a stop string that spans the cut is found there and ends the
  stream (`stopped`);
- `untracked`: a chunk had text but no ids (an engine that ignores `return_token_ids`):
  the stream cannot migrate;
- `failure`: the error event that ended the leg (the relay's, router/flows/common.py), held
  back from the client, and `finished` once a chunk carried a finish_reason.

After `continue_as`, chunks come from a continuation (a completion whatever the client
asked): they are stamped with the client stream's id, created and model, turned into chat
chunks for a chat stream, and its usage is billed as one request (the original prompt, all
completion tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from pdgate.router.engines.resume_text import StopRule, StreamText

__all__ = ["Head", "ResumeEvents"]

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_DATA = b"data: "
_DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Head:
    """The client stream's identity (its first chunk's `id`, `created`, `model`), stamped
    on every chunk a continuation sends; `chat`: the client's stream is chat chunks."""

    id: Any
    created: Any
    model: Any
    chat: bool

    def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A continuation's completion chunk as the client's stream has it: same id,
        created and model; for a chat stream, a chat chunk with the text as its delta."""
        if self.id is None:  # the failed leg sent no chunk: the continuation's identity
            self.id, self.created, self.model = (chunk.get("id"), chunk.get("created"),
                                                 chunk.get("model"))
        out: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk" if self.chat
            else "text_completion", "created": self.created, "model": self.model}
        choices = chunk.get("choices") or []
        out["choices"] = [_chat_choice(c) for c in choices] if self.chat else choices
        if "usage" in chunk:
            out["usage"] = chunk["usage"]
        return out


def _chat_choice(c: dict[str, Any]) -> dict[str, Any]:
    text = c.get("text") or ""
    return {"index": c.get("index", 0), "delta": {"content": text} if text else {},
            "logprobs": None, "finish_reason": c.get("finish_reason"),
            "stop_reason": c.get("stop_reason")}


class ResumeEvents:
    """Reads one client stream's events across its legs (see the module doc). `chat`: the
    client asked for chat chunks; `wants_usage`: for the usage chunk; `stops`: the
    request's stop strings; `exact`: greedy decoding (router/engines/resume_text.py)."""

    def __init__(self, chat: bool, wants_usage: bool, stops: StopRule | None = None, *,
                 exact: bool = True) -> None:
        self.chat = chat
        self.wants_usage = wants_usage
        self.ids: list[int] = []
        self.text = StreamText(stops or StopRule(), exact=exact)
        self.failure: bytes | None = None  # the error event, as the relay wrote it
        self.finished: str | None = None
        self.stopped = False  # a stop string across the cut ended the stream here
        # A chunk had text but listed no ids (an engine without `return_token_ids`): what
        # the client has is then unknown in tokens, and the stream cannot migrate.
        self.untracked = False
        self.usage_sent = False
        self.head: Head | None = None
        self._buf = b""
        self._leg = 0
        self._billed = 0  # completion tokens of the legs before the current one
        self._prompt_tokens = 0
        self._open_chat = False  # a chat continuation must first send the role delta

    @property
    def clean(self) -> int:
        """How many of `ids` a continuation would keep now."""
        return self.text.cut.ids

    @property
    def legs(self) -> int:
        """Legs the stream has had (1 + continuations)."""
        return self._leg + 1

    def continue_as(self, prompt_tokens: int) -> None:
        """A continuation takes over: its prompt kept `ids[:clean]` (the rest it generates
        again); its usage is billed with `prompt_tokens` (the client's prompt)."""
        self.text.restart()
        del self.ids[self.clean:]
        self._leg += 1
        self._billed = self.clean
        self._prompt_tokens = prompt_tokens
        self._buf = b""
        self.failure = None
        if self.head is None:
            self.head = Head(None, None, None, self.chat)
            self._open_chat = self.chat

    def feed(self, piece: bytes) -> bytes:
        """The client's bytes for `piece`: its whole events (a partial one is held),
        token ids removed, an error event and `[DONE]` held back (`end`)."""
        data = self._buf + piece if self._buf else piece
        end = data.rfind(b"\n\n")
        if end < 0:
            self._buf = data
            return b""
        self._buf = data[end + 2:]
        out = [self._event(e.strip(b"\n")) for e in data[:end].split(b"\n\n")]
        return b"".join(out)

    def end(self) -> bytes:
        """How the client's stream ends when no continuation follows: the held error event
        (if any; a stream that had finished gets its usage instead) and `[DONE]`."""
        if self.failure is not None and self.finished is None:
            return self.failure + _DONE_EVENT
        return _DONE_EVENT

    def usage_event(self) -> bytes:
        """The usage chunk of a finished stream whose leg died before sending its own
        (empty when the client did not ask for it or already has it)."""
        if not self.wants_usage or self.usage_sent or self.head is None:
            return b""
        self.usage_sent = True
        completion = len(self.ids)
        usage = {"prompt_tokens": self._prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self._prompt_tokens + completion}
        chunk = {"id": self.head.id, "object": "chat.completion.chunk" if self.chat
                 else "text_completion", "created": self.head.created,
                 "model": self.head.model, "choices": [], "usage": usage}
        return _DATA + _encode(chunk) + b"\n\n"

    def bill_prompt(self, prompt_tokens: int) -> None:
        """The prompt's token count for a usage chunk made by the router."""
        self._prompt_tokens = prompt_tokens

    def _event(self, event: bytes) -> bytes:
        if not event:
            return b""
        if not event.startswith(_DATA):
            return event + b"\n\n"  # a comment or another SSE field: passed on
        payload = event[len(_DATA):]
        if payload == b"[DONE]" or self.stopped:
            return b""  # the migrating stream ends the client's stream itself
        obj = _decode(payload)
        if not isinstance(obj, dict):
            return event + b"\n\n"
        if "error" in obj:
            self.failure = event + b"\n\n"
            return b""
        return self._chunk(obj)

    # Per chunk of a stream (the router's hot path while a stream may migrate): absent keys
    # are tested with `in` rather than popped with a default, a call less each.
    def _chunk(self, obj: dict[str, Any]) -> bytes:
        if "prompt_token_ids" in obj:
            del obj["prompt_token_ids"]
        if "prompt_text" in obj:
            del obj["prompt_text"]
        head = self.head
        if head is None:
            head = self.head = Head(obj.get("id"), obj.get("created"), obj.get("model"),
                                    obj.get("object") == "chat.completion.chunk")
        choices = obj.get("choices") or []
        listed = keep = False
        for c in choices:
            ids, kept = self._choice(c)
            listed, keep = listed or ids, keep or kept
        if self._leg:
            obj = head.rewrite(obj)
        if not choices and obj.get("usage"):
            return self._usage(obj)
        if listed and not keep:
            return b""  # only there to list ids the client did not ask for
        if self._open_chat:
            return self._opening() + _DATA + _encode(obj) + b"\n\n"
        return _DATA + _encode(obj) + b"\n\n"

    def _choice(self, c: dict[str, Any]) -> tuple[bool, bool]:
        """Reads one choice's ids and text and puts the client's text in place of the
        engine's; (it listed ids, the client needs it)."""
        ids = c.pop("token_ids", None) or []
        if "prompt_token_ids" in c:
            del c["prompt_token_ids"]
        if ids:
            self.ids.extend(ids)
        delta: dict[str, Any] | None = None
        if "text" in c:  # a completion's choice
            text = c["text"] or ""
        else:
            got = c.get("delta")
            if isinstance(got, dict):  # a chat chunk's
                delta = got
            text = (delta.get("content") or "") if delta is not None else ""
        if text and not ids:
            self.untracked = True
        finish = c.get("finish_reason")
        st = self.text
        out = st.take(text, len(ids), len(self.ids), finish is not None)
        if st.stop is not None:  # a stop string across the cut ends it here
            finish = c["finish_reason"] = "stop"
            c["stop_reason"] = st.stop
            self.stopped = True
        if finish is not None:
            self.finished = finish
        if delta is None:
            if out or "text" in c:
                c["text"] = out
            return bool(ids), bool(out) or finish is not None
        if out or delta.get("content"):
            delta["content"] = out
        return bool(ids), bool(out) or finish is not None or "role" in delta

    def _opening(self) -> bytes:
        """A chat continuation whose client has no chunk yet opens with the role delta."""
        if not self._open_chat or self.head is None:
            return b""
        self._open_chat = False
        role = {"id": self.head.id, "object": "chat.completion.chunk",
                "created": self.head.created, "model": self.head.model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}]}
        return _DATA + _encode(role) + b"\n\n"

    def _usage(self, obj: dict[str, Any]) -> bytes:
        if self._leg:
            got = obj["usage"].get("completion_tokens")
            completion = self._billed + (got if isinstance(got, int) else 0)
            obj["usage"] = {"prompt_tokens": self._prompt_tokens,
                            "completion_tokens": completion,
                            "total_tokens": self._prompt_tokens + completion}
        if not self.wants_usage:
            return b""
        self.usage_sent = True
        return _DATA + _encode(obj) + b"\n\n"
